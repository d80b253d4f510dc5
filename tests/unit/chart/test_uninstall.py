"""What `helm uninstall` leaves behind: Helm deletes every object of the release except those
annotated `helm.sh/resource-policy: keep` (and a StatefulSet's claims). Found on a real node: with
persistence off, the generated etcd and NATS credentials still outlived the release."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

CHART = Path(__file__).resolve().parents[3] / "charts" / "kvrail"


def kept(helm_binary: Path, *values: str) -> set[str]:
    sets = [a for v in values for a in ("--set", v)]
    done = subprocess.run(
        [str(helm_binary), "template", "kvrail", str(CHART), "--namespace", "kvrail-system",
         "--kube-version", "1.36", *sets],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    docs: list[dict[str, Any]] = [d for d in yaml.safe_load_all(done.stdout) if d]
    return {
        f"{d['kind']}/{d['metadata']['name']}"
        for d in docs
        if d["metadata"].get("annotations", {}).get("helm.sh/resource-policy") == "keep"
    }


@pytest.mark.helm
def test_credentials_outlive_the_release_only_with_the_data_they_protect(
    helm_binary: Path,
) -> None:
    both = {"Secret/kvrail-etcd-credentials", "Secret/kvrail-nats-credentials"}
    assert kept(helm_binary) == both
    off = ("etcd.persistence.enabled=false", "nats.persistence.enabled=false")
    assert kept(helm_binary, *off) == set()
    assert kept(helm_binary, off[0]) == {"Secret/kvrail-nats-credentials"}
