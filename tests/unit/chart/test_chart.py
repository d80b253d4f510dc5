"""The Helm chart `charts/kvrail`: its CRD copy, its values schema, lint, and golden renders.

Schema tests run everywhere (jsonschema); tests marked `helm` run the pinned helm binary.
Golden renders (`golden/<ci file>.yaml`) come from `helm template --kube-version 1.36`, with
generated passwords redacted; rewrite them with `KVRAIL_UPDATE_GOLDEN=1 pytest tests/unit/chart`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvrail.crdgen import CRD_FILENAME, render

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "kvrail"
CI_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.36"
RELEASE, NAMESPACE = "kvrail", "kvrail-system"
REDACTED = "PGdlbmVyYXRlZD4="  # base64 of "<generated>"


def schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())  # type: ignore[no-any-return]


def helm(binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=120, check=False
    )


def template(binary: Path, *args: str) -> str:
    done = helm(binary, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                "--kube-version", KUBE_VERSION, *args)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def redact(text: str) -> str:
    """Replace generated passwords (random per render) in Secrets with a fixed placeholder."""
    docs = text.split("\n---\n")
    return "\n---\n".join(
        re.sub(r"(?m)^(  password: ).*$", rf"\g<1>{REDACTED}", d) if "\nkind: Secret\n" in d else d
        for d in docs
    )


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_chart_crd_is_a_byte_copy_of_the_generated_crd() -> None:
    copy = (CHART / "crds" / CRD_FILENAME).read_text()
    assert copy == render(), f"run: cp crds/{CRD_FILENAME} charts/kvrail/crds/"
    assert [p.name for p in (CHART / "crds").iterdir()] == [CRD_FILENAME]


@pytest.mark.parametrize(
    "path", [CHART / "values.yaml", *CI_FILES], ids=["values.yaml", *[p.name for p in CI_FILES]]
)
def test_values_file_validates_against_the_schema(path: Path) -> None:
    jsonschema.Draft7Validator.check_schema(schema())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    override = yaml.safe_load(path.read_text()) or {}
    jsonschema.validate(_merge(values, override), schema())
    jsonschema.validate(values, schema())


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"operator": {"replicas": 2}}, "Additional properties"),
        ({"etcd": {"enabled": "yes"}}, "is not of type 'boolean'"),
        ({"nats": {"url": "http://nats:4222"}}, "does not match"),
        ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "is not one of"),
        ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "does not match"),
        ({"crds": {"upgrade": True}}, "Additional properties"),
        ({"etcd": {"persistence": {"size": "lots"}}}, "does not match"),
    ],
)
def test_schema_refuses_unknown_keys_and_wrong_types(change: dict[str, Any], error: str) -> None:
    values = _merge(yaml.safe_load((CHART / "values.yaml").read_text()), change)
    with pytest.raises(jsonschema.ValidationError, match=error):
        jsonschema.validate(values, schema())


def test_component_blocks_share_their_sub_keys() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    shared = {"enabled", "image", "resources", "nodeSelector", "tolerations"}
    for block in ("operator", "etcd", "nats"):
        assert shared <= values[block].keys(), block
    assert values["etcd"].keys() - {"endpoints"} == values["nats"].keys() - {"url"}
    assert set(values["crds"]) == {"enabled"}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.mark.helm
def test_helm_lint_is_clean_with_every_ci_values_file(helm_binary: Path) -> None:
    for path in [None, *CI_FILES]:
        args = ["-f", str(path)] if path else []
        done = helm(helm_binary, "lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION,
                    *args)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout


@pytest.mark.helm
@pytest.mark.parametrize("path", CI_FILES, ids=[p.name for p in CI_FILES])
def test_render_matches_the_golden_file(helm_binary: Path, path: Path) -> None:
    rendered = redact(template(helm_binary, "-f", str(path)))
    golden = CHART / "golden" / path.name.replace("-values.yaml", ".yaml")
    if os.environ.get("KVRAIL_UPDATE_GOLDEN") == "1":
        golden.write_text(rendered)
    assert golden.is_file(), f"no {golden}: run with KVRAIL_UPDATE_GOLDEN=1"
    assert rendered == golden.read_text(), f"{golden.name} is stale: KVRAIL_UPDATE_GOLDEN=1"


@pytest.mark.helm
def test_generated_passwords_are_random_and_never_committed(helm_binary: Path) -> None:
    first, second = template(helm_binary), template(helm_binary)
    secrets = [d for d in docs(first) if d["kind"] == "Secret"]
    assert {s["metadata"]["name"] for s in secrets} == {
        "kvrail-etcd-credentials",
        "kvrail-nats-credentials",
    }
    assert first != second, "generated passwords must differ between renders"
    for golden in (CHART / "golden").glob("*.yaml"):
        for doc in docs(golden.read_text()):
            if doc["kind"] == "Secret":
                assert doc["data"]["password"] == REDACTED, golden.name


@pytest.mark.helm
def test_operator_runs_kopf_standalone_on_all_or_listed_namespaces(helm_binary: Path) -> None:
    def args(*values: str) -> list[str]:
        text = template(helm_binary, "--show-only", "templates/operator/deployment.yaml", *values)
        (deployment,) = docs(text)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        return [*container["command"], *container["args"]]

    everywhere = args()
    assert everywhere[:3] == ["kopf", "run", "--standalone"]
    assert "--all-namespaces" in everywhere
    assert everywhere[-2:] == ["-m", "kvrail.operator.main"]
    listed = args("--set", "operator.watchNamespaces={a,b}")
    assert "--all-namespaces" not in listed
    assert {"--namespace=a", "--namespace=b"} <= set(listed)


@pytest.mark.helm
def test_rbac_is_cluster_wide_only_without_watch_namespaces(helm_binary: Path) -> None:
    rbac_kinds = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}

    def kinds(*values: str) -> list[tuple[str, str]]:
        rendered = [d for d in docs(template(helm_binary, *values)) if d["kind"] in rbac_kinds]
        return sorted((d["kind"], d["metadata"].get("namespace", "")) for d in rendered)

    assert kinds() == [("ClusterRole", ""), ("ClusterRole", ""),
                       ("ClusterRoleBinding", ""), ("ClusterRoleBinding", "")]  # fmt: skip
    assert kinds("--set", "operator.watchNamespaces={a,b}") == [
        ("ClusterRole", ""), ("ClusterRoleBinding", ""),
        ("Role", "a"), ("Role", "b"), ("RoleBinding", "a"), ("RoleBinding", "b"),
    ]  # fmt: skip
    text = template(helm_binary, "--show-only", "templates/rbac/clusterrole.yaml")
    granted = {
        (r, v)
        for doc in docs(text)
        if doc["kind"] == "ClusterRole"
        for rule in doc["rules"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert not {v for r, v in granted if r in {"secrets", "pods", "nodes"}}
    assert all(v != "*" and r != "*" for r, v in granted)
    assert ("inferencepools/status", "patch") in granted


@pytest.mark.helm
@pytest.mark.parametrize(
    ("values", "error"),
    [
        (("etcd.endpoints={http://etcd:2379}",), "either enabled"),
        (("nats.url=nats://nats:4222",), "either enabled"),
        (("operator.serviceAccount.create=false",), "serviceAccount.name is required"),
        (("operator.bogus=1",), "additional properties"),
    ],
)
def test_helm_refuses_inconsistent_values(
    helm_binary: Path, values: tuple[str, ...], error: str
) -> None:
    sets = [a for v in values for a in ("--set", v)]
    done = helm(helm_binary, "template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *sets)
    assert done.returncode != 0
    assert error in done.stderr, done.stderr
