"""A vLLM pool's workers: `vllm serve` in the `engine` container beside the kvrail `agent`, with
the resources, placement and volumes kvrail's own workers get from the same fields."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.children import build_children
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.env import worker_env
from kvrail.operator.builders.statefulset import build_statefulset
from kvrail.operator.builders.vllm import serve_config
from kvrail.operator.testing import COLOCATED, VLLM, make_pool, mutate, pool_manifest
from kvrail.settings import Settings
from kvrail.vllm.serve import DEFAULT_VLLM_IMAGE, serve_argv

CTX = BuildContext(image="registry.example/kvrail:test")
GPUS = (
    ("spec.prefill.gpus", 1),
    ("spec.decode.gpus", 1),
)
INFRA = (
    (
        "spec.infrastructure.etcd",
        {"endpoints": ["https://e:2379"], "credentialsSecret": "etcd-user", "caSecret": "etcd-ca"},
    ),
    ("spec.infrastructure.nats", {"url": "tls://n:4222", "credentialsSecret": "nats-user"}),
)
AGENT_ONLY = {"role", "vllm_url"}
"""`KVRAIL_*` variables only the agent reads (`kvrail.agent.vllm`), not (yet) `Settings` fields."""


def vllm_pool(*changes: tuple[str, Any]) -> InferencePool:
    return make_pool(mutate(pool_manifest(), *VLLM, *changes))


def kvrail_pool(*changes: tuple[str, Any]) -> InferencePool:
    return make_pool(mutate(pool_manifest(), ("spec.model.source", "/models/tiny"), *changes))


def pod(pool: InferencePool, role: str = "decode") -> dict[str, Any]:
    sts = build_statefulset(pool, role, CTX)  # type: ignore[arg-type]
    return sts["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def containers(pool: InferencePool, role: str = "decode") -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod(pool, role)["containers"]}


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def flag(argv: list[str], name: str) -> str | None:
    found = [argv[i + 1] for i, arg in enumerate(argv) if arg == name]
    return found[-1] if found else None


def test_each_worker_pod_runs_vllm_then_the_agent() -> None:
    pool = vllm_pool()
    for role in ("prefill", "decode"):
        names = [c["name"] for c in pod(pool, role)["containers"]]
        assert names == ["engine", "agent"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_runs_vllm_serve_with_its_roles_limits_and_the_nixl_connector(role: str) -> None:
    pool = vllm_pool(
        ("spec.prefill.maxNumBatchedTokens", 16384),
        ("spec.decode.maxNumSeqs", 64),
        ("spec.model.maxModelLen", 2048),
        ("spec.disaggregation.minRemotePrefillTokens", 256),
    )
    engine = containers(pool, role)["engine"]
    argv = engine["command"]
    assert argv[:3] == ["vllm", "serve", "/models/tiny"]
    assert argv == serve_argv(serve_config(pool, role, pool.role(role)))  # type: ignore[arg-type]
    expected = {"prefill": ("256", "16384"), "decode": ("64", "8192")}[role]
    assert (flag(argv, "--max-num-seqs"), flag(argv, "--max-num-batched-tokens")) == expected
    assert flag(argv, "--max-model-len") == "2048"
    assert flag(argv, "--served-model-name") == "tiny"
    transfer = json.loads(flag(argv, "--kv-transfer-config") or "null")
    assert transfer["kv_connector"] == "NixlConnector"
    assert transfer["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    assert transfer["kv_buffer_device"] == "cpu"  # the base pool has no GPUs
    assert "args" not in engine  # the image's entrypoint is replaced, not appended to


def test_engine_image_defaults_to_vllms_and_is_overridable() -> None:
    assert containers(vllm_pool())["engine"]["image"] == DEFAULT_VLLM_IMAGE
    custom = vllm_pool(("spec.engine.image", "mine/vllm:1"), ("spec.image", "mine/kvrail:1"))
    assert containers(custom)["engine"]["image"] == "mine/vllm:1"
    assert containers(custom)["agent"]["image"] == "mine/kvrail:1"
    assert containers(vllm_pool())["agent"]["image"] == CTX.image


def test_gpus_set_tensor_parallelism_and_an_fp8_cache_and_extra_args_reach_vllm() -> None:
    pool = vllm_pool(
        ("spec.prefill.gpus", 2),
        ("spec.prefill.parallelism", {"tensor": 2}),
        ("spec.decode.gpus", 2),
        ("spec.decode.parallelism", {"tensor": 2}),
        ("spec.model.dtype", "bfloat16"),
        ("spec.model.kvDtype", "float8_e4m3fn"),
        ("spec.disaggregation.kvLoadFailurePolicy", "fail"),
        ("spec.engine.extraArgs", ["--enforce-eager"]),
    )
    argv = containers(pool)["engine"]["command"]
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--kv-cache-dtype") == "fp8_e4m3"
    transfer = json.loads(flag(argv, "--kv-transfer-config") or "null")
    assert transfer == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",  # containers() shows the decode pool's pod
        "kv_load_failure_policy": "fail",
    }
    assert argv[-1] == "--enforce-eager"


def test_engine_serves_http_and_the_nixl_side_channel_on_the_pod_ip() -> None:
    engine = containers(vllm_pool())["engine"]
    assert engine["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "nixl", "containerPort": 5600, "protocol": "TCP"},
    ]
    values = env(engine)
    assert values["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert values["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"


def test_engine_probes_vllms_health_with_a_long_startup() -> None:
    engine = containers(vllm_pool())["engine"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60


@pytest.mark.parametrize("rdma", ["required", "preferred", "none"])
def test_engine_gets_the_ucx_settings_kvrails_workers_get(rdma: str) -> None:
    changes = (*GPUS, ("spec.topology.rdma", rdma), ("spec.topology.ucxNetDevices", "mlx5_0:1"))
    vllm_env = env(containers(vllm_pool(*changes))["engine"])
    kvrail = kvrail_pool(*changes)
    kvrail_env = {e["name"]: e.get("value") for e in worker_env(kvrail, kvrail.spec.decode, CTX)}
    for name in ("UCX_TLS", "UCX_NET_DEVICES"):
        assert vllm_env[name] == kvrail_env[name], name
    assert ("tcp" in vllm_env["UCX_TLS"].split(",")) is (rdma != "required")


def test_roles_env_comes_last_and_overrides() -> None:
    extra = [
        {"name": "UCX_TLS", "value": "rc,cuda_copy"},
        {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
    ]
    both = containers(vllm_pool(("spec.decode.env", extra)))
    values = env(both["engine"])
    assert values["UCX_TLS"] == "rc,cuda_copy"
    assert values["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert [e["name"] for e in both["engine"]["env"]][-1] == "VLLM_LOGGING_LEVEL"
    assert "VLLM_LOGGING_LEVEL" not in env(both["agent"])


def test_engine_runs_non_root_on_a_read_only_root_with_a_writable_home() -> None:
    engine = containers(vllm_pool())["engine"]
    assert engine["securityContext"]["readOnlyRootFilesystem"] is True
    values = env(engine)
    mounts = {m["mountPath"] for m in engine["volumeMounts"]}
    assert values["HOME"] in mounts
    assert values["USER"]  # torch asks for the user name; a bare UID has none
    assert values["VLLM_NO_USAGE_STATS"] == "1"


def test_pod_placement_volumes_and_resources_match_kvrails_workers() -> None:
    changes = (
        *GPUS,
        ("spec.decode.resources", {"requests": {"cpu": "4", "memory": "16Gi"}}),
        ("spec.decode.nodeSelector", {"gpu": "h200"}),
        ("spec.decode.tolerations", [{"key": "dedicated", "operator": "Exists"}]),
        ("spec.decode.terminationGracePeriodSeconds", 120),
        ("spec.topology.rdma", "required"),
        ("spec.topology.rdmaResource", "rdma/hca"),
        ("spec.model.volumeClaim", "weights"),
        *INFRA,
    )
    vllm, kvrail = pod(vllm_pool(*changes)), pod(kvrail_pool(*changes))
    for key in set(kvrail) - {"containers"}:
        assert vllm[key] == kvrail[key], key
    assert set(vllm) == set(kvrail)
    engine = vllm["containers"][0]
    (worker,) = kvrail["containers"]
    assert engine["resources"] == worker["resources"]
    assert engine["resources"]["limits"] == {"nvidia.com/gpu": 1, "rdma/hca": 1}
    assert engine["securityContext"] == worker["securityContext"]  # IPC_LOCK for RDMA


def test_only_the_agent_mounts_etcd_and_nats_credentials_and_only_the_engine_the_weights() -> None:
    both = containers(vllm_pool(*INFRA, ("spec.model.volumeClaim", "weights")))
    engine = {m["name"] for m in both["engine"]["volumeMounts"]}
    agent = {m["name"] for m in both["agent"]["volumeMounts"]}
    assert engine == {"cache", "tmp", "shm", "models"}
    assert agent == {"tmp", "etcd-credentials", "etcd-ca", "nats-credentials"}
    assert not [n for n in env(both["engine"]) if n.startswith("KVRAIL_")]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_agent_registers_the_server_with_the_pools_identity_and_planes(role: str) -> None:
    pool = vllm_pool(*INFRA, ("spec.model.servedName", "tiny-chat"))
    agent = containers(pool, role)["agent"]
    assert agent["command"] == ["python", "-P", "-m", "kvrail.agent"]
    values = env(agent)
    assert values["KVRAIL_ROLE"] == role
    assert values["KVRAIL_VLLM_URL"] == "http://127.0.0.1:8000"
    assert values["KVRAIL_SERVED_MODEL_NAME"] == "tiny-chat"
    assert values["KVRAIL_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # etcd and NATS exactly as a kvrail worker of the same pool gets them.
    kvrail = kvrail_pool(*INFRA)
    worker = {
        e["name"]: e.get("value", e.get("valueFrom"))
        for e in worker_env(kvrail, kvrail.spec.decode, CTX)
    }
    for name in ("KVRAIL_POOL", "KVRAIL_ETCD_ENDPOINTS", "KVRAIL_ETCD_USERNAME",
                 "KVRAIL_ETCD_PASSWORD_FILE", "KVRAIL_ETCD_CA_FILE", "KVRAIL_NATS_URL",
                 "KVRAIL_NATS_USER", "KVRAIL_NATS_PASSWORD_FILE"):  # fmt: skip
        assert values[name] == worker[name], name
    assert [e["name"] for e in agent["env"]].count("KVRAIL_SERVED_MODEL_NAME") == 1


def test_agent_is_small_and_holds_no_gpu() -> None:
    agent = containers(vllm_pool(*GPUS))["agent"]
    assert agent["resources"] == {
        "requests": {"cpu": "50m", "memory": "128Mi"},
        "limits": {"memory": "256Mi"},
    }
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "ports" not in agent


def test_agent_serves_the_source_name_when_the_spec_names_none() -> None:
    values = env(containers(vllm_pool())["agent"])
    assert values["KVRAIL_SERVED_MODEL_NAME"] == "tiny"


def test_colocated_vllm_pool_is_one_decode_pool_without_a_connector() -> None:
    pool = vllm_pool(*COLOCATED)
    children = build_children(pool, CTX)
    sets = [c["metadata"]["name"] for c in children if c["kind"] == "StatefulSet"]
    assert sets == ["tiny-decode"]
    both = containers(pool)
    argv = both["engine"]["command"]
    assert "--kv-transfer-config" not in argv
    assert [p["name"] for p in both["engine"]["ports"]] == ["http"]
    assert not [n for n in env(both["engine"]) if n.startswith("VLLM_NIXL")]
    assert env(both["agent"])["KVRAIL_ROLE"] == "colocated"


def test_worker_services_name_vllms_port() -> None:
    children = build_children(vllm_pool(), CTX)
    for child in children:
        if child["kind"] == "Service" and child["metadata"]["name"] != "tiny-router":
            assert child["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]


def test_router_is_the_same_as_for_a_kvrail_pool_but_for_the_model_hash() -> None:
    def router(pool: InferencePool) -> dict[str, Any]:
        (dep,) = [c for c in build_children(pool, CTX) if c["kind"] == "Deployment"]
        return dep["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]

    vllm, kvrail = router(vllm_pool()), router(kvrail_pool())
    assert vllm["command"] == kvrail["command"] == ["python", "-P", "-m", "kvrail.router"]
    assert {e["name"] for e in vllm["env"]} == {e["name"] for e in kvrail["env"]}


def test_every_kvrail_variable_of_a_vllm_pool_is_a_settings_field_or_the_agents_own() -> None:
    pool = vllm_pool(*INFRA, ("spec.model.revision", "r1"), ("spec.security.apiKeysSecret", "k"))
    names = set()
    for child in build_children(pool, CTX):
        if child["kind"] in ("StatefulSet", "Deployment"):
            for container in child["spec"]["template"]["spec"]["containers"]:
                names |= {e["name"] for e in container["env"] if e["name"].startswith("KVRAIL_")}
    fields = {n.removeprefix("KVRAIL_").lower() for n in names}
    assert fields >= AGENT_ONLY
    unknown = fields - set(Settings.model_fields) - AGENT_ONLY
    assert not unknown, f"kvrail.settings refuses these at start: {sorted(unknown)}"
