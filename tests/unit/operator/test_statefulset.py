"""Worker StatefulSets: command, identity, settings, placement, volumes and rolling."""

from __future__ import annotations

from typing import Any

import pytest

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.statefulset import build_statefulset
from kvrail.operator.testing import DELETE, make_pool, mutate, pool_manifest

CTX = BuildContext(image="registry.example/kvrail:test")
COLOCATED = (("spec.prefill", DELETE), ("spec.disaggregation.mode", "colocated"))


def pool_with(*changes: tuple[str, Any]) -> InferencePool:
    return make_pool(mutate(pool_manifest(), *changes))


def pod(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def env(sts: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod(sts)["containers"][0]["env"]}


@pytest.mark.parametrize(
    ("changes", "role", "expected"),
    [
        ((), "prefill", "prefill"),
        ((), "decode", "decode"),
        (COLOCATED, "decode", "colocated"),
    ],
)
def test_worker_command_is_the_worker_cli_with_its_role(
    changes: Any, role: str, expected: str
) -> None:
    sts = build_statefulset(pool_with(*changes), role, CTX)  # type: ignore[arg-type]
    assert pod(sts)["containers"][0]["command"] == [
        "python", "-P", "-m", "kvrail.worker", "--role", expected,
    ]  # fmt: skip


def test_building_a_role_the_pool_lacks_raises() -> None:
    with pytest.raises(ValueError, match="no prefill"):
        build_statefulset(pool_with(*COLOCATED), "prefill", CTX)


def test_statefulset_selects_its_pods_by_pool_and_role_and_owns_them_through_the_pool() -> None:
    sts = build_statefulset(pool_with(("spec.decode.replicas", 3)), "decode", CTX)
    spec = sts["spec"]
    assert sts["metadata"]["name"] == spec["serviceName"] == "tiny-decode"
    assert spec["replicas"] == 3
    assert spec["podManagementPolicy"] == "Parallel"
    selector = spec["selector"]["matchLabels"]
    assert selector == {"kvrail.dev/pool": "tiny", "kvrail.dev/role": "decode"}
    assert selector.items() <= spec["template"]["metadata"]["labels"].items()
    (owner,) = sts["metadata"]["ownerReferences"]
    assert owner["kind"] == "InferencePool"
    assert owner["uid"] == "uid-1"
    assert owner["controller"] is True


def test_image_defaults_to_the_operator_and_is_overridable() -> None:
    assert pod(build_statefulset(make_pool(), "decode", CTX))["containers"][0]["image"] == CTX.image
    custom = pool_with(("spec.image", "mine:1"))
    assert pod(build_statefulset(custom, "decode", CTX))["containers"][0]["image"] == "mine:1"


def test_worker_env_carries_pod_identity_from_the_downward_api() -> None:
    values = env(build_statefulset(make_pool(), "prefill", CTX))
    assert values["KVRAIL_POOL"] == "tiny"
    assert values["KVRAIL_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert values["KVRAIL_POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert values["KVRAIL_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_fingerprint_settings_are_identical_on_both_roles() -> None:
    pool = pool_with(("spec.model.kvDtype", "float8_e4m3fn"), ("spec.model.blockSize", 32))
    keys = [
        "KVRAIL_MODEL",
        "KVRAIL_DTYPE",
        "KVRAIL_KV_DTYPE",
        "KVRAIL_BLOCK_SIZE",
        "KVRAIL_TENSOR_PARALLEL_SIZE",
        "KVRAIL_MODEL_HASH",
    ]
    prefill, decode = (env(build_statefulset(pool, r, CTX)) for r in ("prefill", "decode"))
    assert [prefill[k] for k in keys] == [decode[k] for k in keys]
    assert decode["KVRAIL_KV_DTYPE"] == "float8_e4m3fn"
    assert decode["KVRAIL_BLOCK_SIZE"] == "32"


def test_kv_dtype_auto_resolves_to_the_model_dtype() -> None:
    assert env(build_statefulset(make_pool(), "decode", CTX))["KVRAIL_KV_DTYPE"] == "float32"


def test_infrastructure_defaults_come_from_the_operator_and_the_spec_overrides_them() -> None:
    values = env(build_statefulset(make_pool(), "decode", CTX))
    assert values["KVRAIL_ETCD_ENDPOINTS"] == ",".join(CTX.etcd_endpoints)
    assert values["KVRAIL_NATS_URL"] == CTX.nats_url
    pool = pool_with(
        ("spec.infrastructure.etcd", {"endpoints": ["https://e1:2379", "https://e2:2379"]}),
        ("spec.infrastructure.nats", {"url": "tls://n:4222"}),
    )
    values = env(build_statefulset(pool, "decode", CTX))
    assert values["KVRAIL_ETCD_ENDPOINTS"] == "https://e1:2379,https://e2:2379"
    assert values["KVRAIL_NATS_URL"] == "tls://n:4222"


def test_credentials_are_mounted_files_never_values() -> None:
    creds = {"credentialsSecret": "etcd-auth", "caSecret": "etcd-ca"}
    pool = pool_with(("spec.infrastructure.etcd", {"endpoints": ["https://e:2379"], **creds}))
    sts = build_statefulset(pool, "decode", CTX)
    values = env(sts)
    assert values["KVRAIL_ETCD_USERNAME"] == {
        "secretKeyRef": {"name": "etcd-auth", "key": "username"}
    }
    assert (
        values["KVRAIL_ETCD_PASSWORD_FILE"] == "/var/run/secrets/kvrail/etcd-credentials/password"
    )
    assert values["KVRAIL_ETCD_CA_FILE"] == "/var/run/secrets/kvrail/etcd-ca/ca.crt"
    volumes = {v["name"]: v for v in pod(sts)["volumes"]}
    assert volumes["etcd-credentials"]["secret"]["secretName"] == "etcd-auth"
    mounts = {m["name"]: m for m in pod(sts)["containers"][0]["volumeMounts"]}
    assert mounts["etcd-ca"]["readOnly"] is True


def test_user_env_overrides_by_name_and_names_stay_unique() -> None:
    pool = pool_with(
        ("spec.decode.env", [{"name": "UCX_TLS", "value": "tcp"}, {"name": "X", "value": "1"}])
    )
    names = [e["name"] for e in pod(build_statefulset(pool, "decode", CTX))["containers"][0]["env"]]
    assert len(names) == len(set(names))
    assert env(build_statefulset(pool, "decode", CTX))["UCX_TLS"] == "tcp"


def test_heterogeneous_roles_get_their_own_node_selectors_and_gpus() -> None:
    pool = pool_with(
        ("spec.prefill.nodeSelector", {"gpu": "h100"}),
        ("spec.prefill.gpus", 1),
        ("spec.decode.nodeSelector", {"gpu": "l40s"}),
        ("spec.decode.gpus", 1),
    )
    prefill, decode = (pod(build_statefulset(pool, r, CTX)) for r in ("prefill", "decode"))
    assert prefill["nodeSelector"] == {"gpu": "h100"}
    assert decode["nodeSelector"] == {"gpu": "l40s"}
    assert prefill["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}


def test_model_volume_claim_is_mounted_read_only_at_models() -> None:
    sts = build_statefulset(pool_with(("spec.model.volumeClaim", "weights")), "decode", CTX)
    volumes = {v["name"]: v for v in pod(sts)["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


def test_containers_are_hardened_and_rdma_adds_only_ipc_lock() -> None:
    spec = pod(build_statefulset(pool_with(("spec.topology.rdma", "required")), "decode", CTX))
    ctx = spec["containers"][0]["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False


ROLLS: list[tuple[str, tuple[str, Any], bool]] = [
    ("model source", ("spec.model.source", "/models/llama"), True),
    ("model revision", ("spec.model.revision", "r2"), True),
    ("kv dtype", ("spec.model.kvDtype", "float16"), True),
    ("decode replicas", ("spec.decode.replicas", 5), False),
    ("router policy", ("spec.router.policy", "round-robin"), False),
]


@pytest.mark.parametrize(("case", "change", "changes_hash"), ROLLS, ids=[c[0] for c in ROLLS])
def test_model_hash_label_changes_only_with_the_model(
    case: str, change: tuple[str, Any], changes_hash: bool
) -> None:
    def label(pool: InferencePool, role: str) -> str:
        sts = build_statefulset(pool, role, CTX)  # type: ignore[arg-type]
        return sts["spec"]["template"]["metadata"]["labels"]["kvrail.dev/model-hash"]  # type: ignore[no-any-return]

    before, after = make_pool(), pool_with(change)
    for role in ("prefill", "decode"):
        assert (label(before, role) != label(after, role)) is changes_hash
    assert label(after, "prefill") == label(after, "decode")


@pytest.mark.parametrize(("grace_s", "drain_s"), [(60, 50), (30, 24), (5, 4), (0, 0)])
def test_workers_drain_within_the_grace_period_leaving_time_to_deregister(
    grace_s: int, drain_s: int
) -> None:
    decode = pool_with(("spec.decode.terminationGracePeriodSeconds", grace_s))
    sts = build_statefulset(decode, "decode", CTX)
    assert pod(sts)["terminationGracePeriodSeconds"] == grace_s
    assert env(sts)["KVRAIL_DRAIN_TIMEOUT_S"] == str(drain_s)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_gpus_make_one_pod_with_that_many_gpus_running_that_many_tensor_parallel_ranks(
    role: str,
) -> None:
    """`gpus: 4` alone is TP=4 for kvrail's engine: each replica is one pod (one node) asking for
    four GPUs, whose worker runs four ranks; the model hash (a pod label) is the one of an
    explicit `parallelism.tensor: 4`, so stating it or not rolls no pod."""
    pool = pool_with(("spec.prefill.gpus", 4), ("spec.decode.gpus", 4))
    sts = build_statefulset(pool, role, CTX)  # type: ignore[arg-type]
    (worker,) = [c for c in pod(sts)["containers"] if c["name"] == "worker"]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert env(sts)["KVRAIL_TENSOR_PARALLEL_SIZE"] == "4"
    explicit = pool_with(
        ("spec.prefill.gpus", 4), ("spec.prefill.parallelism", {"tensor": 4}),
        ("spec.decode.gpus", 4), ("spec.decode.parallelism", {"tensor": 4}),
    )  # fmt: skip
    labels = sts["spec"]["template"]["metadata"]["labels"]
    explicit_sts = build_statefulset(explicit, role, CTX)  # type: ignore[arg-type]
    assert explicit_sts["spec"]["template"]["metadata"]["labels"] == labels


def test_a_cpu_pool_runs_one_rank() -> None:
    assert env(build_statefulset(pool_with(), "decode", CTX))["KVRAIL_TENSOR_PARALLEL_SIZE"] == "1"
