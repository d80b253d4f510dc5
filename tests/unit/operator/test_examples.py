"""Every manifest in `examples/` parses, passes the CRD's rules and builds its children."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.children import build_children
from kvrail.operator.builders.context import BuildContext
from kvrail.testing.cel import violations

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))


def load(name: str) -> dict[str, Any]:
    (path,) = [p for p in EXAMPLES if p.name == name]
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


def workload(name: str, kind: str, suffix: str) -> dict[str, Any]:
    pool = InferencePool.model_validate(load(name))
    children = build_children(pool, BuildContext())
    (found,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"].endswith(suffix)]
    return found


def test_the_documented_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"cpu-small.yaml", "gpu-8b-rdma.yaml", "heterogeneous.yaml", "vllm-pool.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_a_valid_pool(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    pool = InferencePool.model_validate(manifest)
    assert violations(manifest) == []
    assert build_children(pool, BuildContext())


def test_rdma_example_requires_rdma_nodes_and_devices() -> None:
    spec = workload("gpu-8b-rdma.yaml", "StatefulSet", "-decode")["spec"]["template"]["spec"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in spec["affinity"]["nodeAffinity"]
    limits = spec["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 1, "rdma/rdma_shared_device_a": 1}
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert "tcp" not in env["UCX_TLS"].split(",")


def test_heterogeneous_example_puts_roles_on_different_gpus() -> None:
    prefill = workload("heterogeneous.yaml", "StatefulSet", "-prefill")["spec"]["template"]["spec"]
    decode = workload("heterogeneous.yaml", "StatefulSet", "-decode")["spec"]["template"]["spec"]
    assert prefill["nodeSelector"] != decode["nodeSelector"]


def test_vllm_example_runs_vllm_serve_beside_the_agent_on_a_gpu() -> None:
    for suffix in ("-prefill", "-decode"):
        spec = workload("vllm-pool.yaml", "StatefulSet", suffix)["spec"]["template"]["spec"]
        engine, agent = spec["containers"]
        assert (engine["name"], agent["name"]) == ("engine", "agent")
        assert engine["command"][:3] == ["vllm", "serve", "/models/Meta-Llama-3-8B-Instruct"]
        assert "--kv-transfer-config" in engine["command"]
        assert engine["command"][-2:] == ["--gpu-memory-utilization", "0.85"]
        assert engine["resources"]["limits"] == {"nvidia.com/gpu": 1}
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in engine[
            "volumeMounts"
        ]
        assert agent["command"] == ["python", "-P", "-m", "kvrail.agent"]


def test_the_kv_tiers_example_grows_decode_memory_and_mounts_its_disk_tier() -> None:
    sts = workload("gpu-8b-kv-tiers.yaml", "StatefulSet", "-decode")
    worker = sts["spec"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["requests"]["memory"] == "320Gi"  # 64Gi + the 256Gi host tier
    assert worker["resources"]["limits"]["memory"] == "352Gi"
    assert {"name": "kv-disk", "mountPath": "/var/lib/kvrail/kv"} in worker["volumeMounts"]
    prefill = workload("gpu-8b-kv-tiers.yaml", "StatefulSet", "-prefill")
    assert (
        prefill["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"]
        == "64Gi"
    )


def test_the_agents_example_mounts_the_template_its_comment_creates() -> None:
    """The ConfigMap and file that the example's `kubectl create configmap` line names are the
    ones its router mounts; the file's rendering is tested with the router
    (tests/unit/router/test_template_file.py)."""
    path = EXAMPLES[0].parent / "agents-tools.yaml"
    command = path.read_text().split("create configmap ", 1)[1].split("\n", 2)
    name, source = command[0].split()[0], command[1].split("=")[-1].strip()
    assert (EXAMPLES[0].parents[1] / source).is_file(), source
    dep = workload("agents-tools.yaml", "Deployment", "-router")["spec"]["template"]["spec"]
    (volume,) = [v["configMap"] for v in dep["volumes"] if "configMap" in v]
    assert volume["name"] == name
    env = {e["name"]: e.get("value") for e in dep["containers"][0]["env"]}
    assert env["KVRAIL_CHAT_TEMPLATE"].endswith("/chat_template.jinja")
    assert (env["KVRAIL_TOOL_CALL_PARSER"], env["KVRAIL_REASONING_PARSER"]) == ("hermes", "none")


def test_gaie_example_renders_the_gaie_pool_the_picker_and_the_fronts() -> None:
    gaie_pool = workload("cpu-small-gaie.yaml", "InferencePool", "-gaie")
    assert gaie_pool["spec"]["endpointPickerRef"]["name"] == "smol-gaie-epp"
    epp = workload("cpu-small-gaie.yaml", "Deployment", "-epp")
    assert epp["spec"]["template"]["spec"]["containers"][0]["command"][3] == "kvrail.epp"
    decode = workload("cpu-small-gaie.yaml", "StatefulSet", "-decode")
    names = [c["name"] for c in decode["spec"]["template"]["spec"]["containers"]]
    assert names == ["worker", "front"]
