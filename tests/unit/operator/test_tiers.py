"""A role's KV tiers in its pods: the worker's settings, memory grown by the host tier, the disk
tier's volume, and vLLM's native offloading."""

from __future__ import annotations

from typing import Any

import pytest

from kvrail.crd.pool import InferencePool
from kvrail.crd.quantity import quantity_bytes
from kvrail.crd.tiers import RESERVED_PATHS
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.statefulset import build_statefulset
from kvrail.operator.builders.tiers import DISK_VOLUME, disk_volume_bytes
from kvrail.operator.testing import COLOCATED, VLLM, make_pool, mutate, pool_manifest
from kvrail.operator.testing_tiers import HOST_64GI, HOST_AND_DISK
from kvrail.settings import Settings

CTX = BuildContext(image="registry.example/kvrail:test")
GI = 1 << 30


def pool_with(*changes: tuple[str, Any]) -> InferencePool:
    return make_pool(mutate(pool_manifest(), *changes))


def engine(pool: InferencePool, role: str = "decode") -> dict[str, Any]:
    sts = build_statefulset(pool, role, CTX)  # type: ignore[arg-type]
    return sts["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def volumes(pool: InferencePool, role: str = "decode") -> dict[str, dict[str, Any]]:
    sts = build_statefulset(pool, role, CTX)  # type: ignore[arg-type]
    return {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_pool_without_tiers_gets_no_tier_settings_resources_or_volume() -> None:
    worker = engine(pool_with())
    assert not [name for name in env(worker) if "TIER" in name]
    assert "resources" not in worker or "memory" not in worker["resources"].get("requests", {})
    assert DISK_VOLUME not in volumes(pool_with())


def test_tiers_reach_the_worker_as_settings_it_accepts() -> None:
    worker = engine(pool_with(("spec.decode.kvTiers", HOST_AND_DISK)))
    values = env(worker)
    assert values["KVRAIL_KV_HOST_TIER_BYTES"] == str(64 * GI)
    assert values["KVRAIL_KV_DISK_TIER_PATH"] == "/var/lib/kvrail/kv"
    assert values["KVRAIL_KV_DISK_TIER_BYTES"] == str(500 * GI)
    settings = Settings.model_validate({
        "kv_host_tier_bytes": values["KVRAIL_KV_HOST_TIER_BYTES"],
        "kv_disk_tier_path": values["KVRAIL_KV_DISK_TIER_PATH"],
        "kv_disk_tier_bytes": values["KVRAIL_KV_DISK_TIER_BYTES"],
    })  # fmt: skip
    assert settings.kv_disk_tier_bytes == 500 * GI


def test_tiers_are_per_role() -> None:
    pool = pool_with(("spec.decode.kvTiers", HOST_64GI))
    assert "KVRAIL_KV_HOST_TIER_BYTES" in env(engine(pool, "decode"))
    assert "KVRAIL_KV_HOST_TIER_BYTES" not in env(engine(pool, "prefill"))


@pytest.mark.parametrize(
    ("resources", "request_bytes", "limit_bytes"),
    [
        ({}, 64 * GI, None),
        ({"requests": {"memory": "16Gi"}}, 80 * GI, None),
        ({"requests": {"memory": "16Gi"}, "limits": {"memory": "32Gi"}}, 80 * GI, 96 * GI),
        ({"limits": {"memory": "32Gi"}}, 96 * GI, 96 * GI),  # the request defaults to the limit
        ({"requests": {"memory": "16G"}}, 16 * 10**9 + 64 * GI, None),
    ],
)
def test_host_tier_grows_the_memory_request_and_limit_by_its_bytes(
    resources: dict[str, Any], request_bytes: int, limit_bytes: int | None
) -> None:
    pool = pool_with(("spec.decode.kvTiers", HOST_64GI), ("spec.decode.resources", resources))
    got = engine(pool)["resources"]
    assert quantity_bytes(got["requests"]["memory"]) == request_bytes
    if limit_bytes is None:
        assert "memory" not in got.get("limits", {})
    else:
        assert quantity_bytes(got["limits"]["memory"]) == limit_bytes


def test_disk_tier_is_an_empty_dir_at_its_path_with_headroom_requested_as_local_storage() -> None:
    pool = pool_with(("spec.decode.kvTiers", HOST_AND_DISK))
    volume = volumes(pool)[DISK_VOLUME]
    size_limit = quantity_bytes(volume["emptyDir"]["sizeLimit"])
    assert volume == {
        "name": DISK_VOLUME,
        "emptyDir": {"sizeLimit": volume["emptyDir"]["sizeLimit"]},
    }
    assert 500 * GI < size_limit == disk_volume_bytes(500 * GI) <= 500 * GI * 65 // 64
    worker = engine(pool)
    assert {"name": DISK_VOLUME, "mountPath": "/var/lib/kvrail/kv"} in worker["volumeMounts"]
    assert quantity_bytes(worker["resources"]["requests"]["ephemeral-storage"]) == size_limit
    assert "ephemeral-storage" not in worker["resources"].get("limits", {})


def test_a_small_disk_tier_still_gets_64mi_of_headroom() -> None:
    assert disk_volume_bytes(1 << 20) == (1 << 20) + (64 << 20)


def test_tiers_of_size_0_are_off() -> None:
    tiers = {"host": {"size": "0"}, "disk": {"path": "/nvme/kv", "size": "0"}}
    pool = pool_with(("spec.decode.kvTiers", tiers))
    assert not [name for name in env(engine(pool)) if "TIER" in name]
    assert DISK_VOLUME not in volumes(pool)


def test_the_pods_own_mounts_are_the_paths_a_disk_tier_may_not_use() -> None:
    pool = pool_with(
        ("spec.decode.kvTiers", HOST_AND_DISK), ("spec.model.volumeClaim", "weights"),
        ("spec.infrastructure.etcd", {"endpoints": ["https://etcd:2379"], "caSecret": "ca"}),
    )  # fmt: skip
    for mount in engine(pool)["volumeMounts"]:
        if mount["name"] == DISK_VOLUME:
            continue
        path = mount["mountPath"]
        assert any(path == p or path.startswith(p + "/") for p in RESERVED_PATHS), path


def test_vllm_host_tier_is_its_native_offloading_and_grows_its_memory() -> None:
    pool = make_pool(mutate(pool_manifest(), *VLLM, *COLOCATED, ("spec.decode.kvTiers", HOST_64GI)))
    container = engine(pool)
    argv = container["command"]
    assert argv[argv.index("--kv-offloading-backend") + 1] == "native"
    assert argv[argv.index("--kv-offloading-size") + 1] == "64"
    assert quantity_bytes(container["resources"]["requests"]["memory"]) == 64 * GI
    assert not [name for name in env(container) if name.startswith("KVRAIL_KV_")]
