"""What the chart gives the pools: a Gateway their HTTPRoutes attach to, the one image, and the
operator's access to the chart's etcd and NATS. Each was missing when `helm install` and the
CPU example first ran on a real kubelet (tests/node): no Gateway to attach to, workers started
from ghcr.io (unreachable where the chart's image was mirrored) and refused by the chart's NATS.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrail.operator.builders.children import build_children
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.httproute import build_httproute
from kvrail.operator.testing import make_pool
from kvrail.settings import load_settings

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "kvrail"
RELEASE, NAMESPACE = "kvrail", "kvrail-system"  # the names the examples and docs use


def helm_template(helm_binary: Path, *values: str) -> subprocess.CompletedProcess[str]:
    sets = [a for v in values for a in ("--set", v)]
    return subprocess.run(
        [str(helm_binary), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--kube-version", "1.36", *sets],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def render(helm_binary: Path, *values: str) -> list[dict[str, Any]]:
    done = helm_template(helm_binary, *values)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def operator_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.mark.helm
def test_no_gateway_by_default_and_one_http_listener_when_enabled(helm_binary: Path) -> None:
    assert not [d for d in render(helm_binary) if d["kind"] == "Gateway"]
    docs = render(helm_binary, "gateway.enabled=true", "gateway.className=traefik",
                  "gateway.port=8000", "gateway.hostname=llm.example.com")  # fmt: skip
    (gateway,) = [d for d in docs if d["kind"] == "Gateway"]
    assert gateway["metadata"] == {
        "name": RELEASE,
        "namespace": NAMESPACE,
        "labels": gateway["metadata"]["labels"],
    }
    assert gateway["spec"] == {
        "gatewayClassName": "traefik",
        "listeners": [{
            "name": "http", "protocol": "HTTP", "port": 8000, "hostname": "llm.example.com",
            "allowedRoutes": {"namespaces": {"from": "All"}},
        }],
    }  # fmt: skip


@pytest.mark.helm
def test_an_enabled_gateway_needs_a_class(helm_binary: Path) -> None:
    done = helm_template(helm_binary, "gateway.enabled=true")
    assert done.returncode != 0
    assert "gateway.className is required" in done.stderr


@pytest.mark.helm
def test_the_cpu_example_attaches_to_the_charts_gateway(helm_binary: Path) -> None:
    docs = render(helm_binary, "gateway.enabled=true", "gateway.className=traefik")
    (gateway,) = [d for d in docs if d["kind"] == "Gateway"]
    example = yaml.safe_load((REPO / "examples" / "cpu-small.yaml").read_text())
    route = build_httproute(make_pool(example))
    assert route is not None
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["name"], parent["namespace"]) == (
        gateway["metadata"]["name"],
        gateway["metadata"]["namespace"],
    )
    # The example's pool lives in another namespace: the listener must admit its route.
    assert gateway["spec"]["listeners"][0]["allowedRoutes"]["namespaces"]["from"] == "All"


@pytest.mark.helm
@pytest.mark.parametrize(
    ("values", "image"),
    [((), "ghcr.io/kvrail/kvrail:0.1.0"),
     (("operator.image.repository=mirror.example/kvrail", "operator.image.tag=dev-1"),
      "mirror.example/kvrail:dev-1")],
    ids=["default", "mirrored"],
)  # fmt: skip
def test_pools_default_to_the_image_the_operator_runs(
    helm_binary: Path, values: tuple[str, ...], image: str
) -> None:
    docs = render(helm_binary, *values)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == image
    settings = load_settings(environ=operator_env(docs))
    assert settings.operator_image == image


@pytest.mark.helm
@pytest.mark.parametrize("share", [True, False])
def test_operator_shares_its_access_with_pools_as_the_value_says(
    helm_binary: Path, share: bool
) -> None:
    docs = render(helm_binary, f"operator.shareAccess={str(share).lower()}")
    assert load_settings(environ=operator_env(docs)).operator_share_access is share


def cpu_millis(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def requested_millis(pod_spec: dict[str, Any], replicas: int) -> int:
    return replicas * sum(
        cpu_millis(c.get("resources", {}).get("requests", {}).get("cpu", "0"))
        for c in pod_spec["containers"]
    )


@pytest.mark.helm
def test_the_cpu_example_with_two_prefill_workers_and_the_chart_fit_two_cores(
    helm_binary: Path,
) -> None:
    """`kvrail.testing.node` has one 2-core node; the journey scales prefill to 2. CPU requests
    are what the scheduler counts (1 CPU per worker left the first worker Pending)."""
    chart = sum(
        requested_millis(d["spec"]["template"]["spec"], d["spec"].get("replicas", 1))
        for d in render(helm_binary)
        if d["kind"] in ("Deployment", "StatefulSet")
    )
    example = yaml.safe_load((REPO / "examples" / "cpu-small.yaml").read_text())
    example["spec"]["prefill"]["replicas"] = 2
    pool = make_pool(example)
    children = build_children(pool, BuildContext())
    workloads = sum(
        requested_millis(c["spec"]["template"]["spec"], c["spec"]["replicas"])
        for c in children
        if c["kind"] in ("Deployment", "StatefulSet")
    )
    platform = 100  # the harness's CoreDNS and Traefik
    assert chart + workloads + platform <= 2000, (chart, workloads)
