"""A role's KV tiers in its pods: settings, memory, and the disk tier's volume.

- Host tier: the worker gets `KVRAIL_KV_HOST_TIER_BYTES` (vLLM gets its offloading flags from
  `kvrail.vllm.serve`). Pinned host memory is charged to the pod's memory cgroup, so the engine
  container's memory request and limit both grow by the tier's bytes: the scheduler places the
  pod where the memory is, and the tier never pushes the worker's own memory into an OOM kill.
  A role without a memory request gets one of the tier's size; without a limit it gets none.
- Disk tier: an `emptyDir` mounted at the tier's path, its `sizeLimit` the tier's size plus
  headroom for the tier's bookkeeping (an index, a block being written), and the same amount
  requested as ephemeral storage so the pod lands on a node with that much local disk (on GPU
  nodes, the kubelet's root or NVMe). The worker gets `KVRAIL_KV_DISK_TIER_PATH` and
  `KVRAIL_KV_DISK_TIER_BYTES` (the tier's size, which it never exceeds). The directory outlives a
  container restart of the same pod (the worker validates and checksums what it finds there)
  and is deleted with the pod. No hostPath, no privileges: the pod's own UID owns the volume.
"""

from __future__ import annotations

from typing import Any, Final

from kvrail.crd.quantity import format_bytes, quantity_bytes
from kvrail.crd.spec import RoleSpec

DISK_VOLUME: Final = "kv-disk"
MIN_DISK_HEADROOM_BYTES: Final = 64 << 20
DISK_HEADROOM_FRACTION: Final = 64
"""The disk volume's headroom over the tier: 1/64 of it (1.6%), at least 64 MiB."""


def disk_volume_bytes(disk_bytes: int) -> int:
    """The disk tier's `emptyDir` size limit (and ephemeral-storage request) for a tier of
    `disk_bytes`: the kubelet evicts a pod whose volume outgrows it, so it has headroom."""
    return disk_bytes + max(MIN_DISK_HEADROOM_BYTES, -(-disk_bytes // DISK_HEADROOM_FRACTION))


def tier_settings(spec: RoleSpec) -> list[tuple[str, object]]:
    """The worker's tier settings (`kvrail.settings` fields and values; `builders.env` sets
    them); none for a tier that is off."""
    tiers = spec.kv_tiers
    out: list[tuple[str, object]] = []
    if tiers.host_bytes:
        out.append(("kv_host_tier_bytes", tiers.host_bytes))
    if tiers.disk is not None and tiers.disk_bytes:
        out.append(("kv_disk_tier_path", tiers.disk.path))
        out.append(("kv_disk_tier_bytes", tiers.disk_bytes))
    return out


def tier_volumes(spec: RoleSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of the disk tier: an `emptyDir` at its path; none without one."""
    disk = spec.kv_tiers.disk
    if disk is None or not disk.num_bytes:
        return [], []
    limit = format_bytes(disk_volume_bytes(disk.num_bytes))
    return (
        [{"name": DISK_VOLUME, "emptyDir": {"sizeLimit": limit}}],
        [{"name": DISK_VOLUME, "mountPath": disk.path}],
    )


def add_tier_resources(spec: RoleSpec, requests: dict[str, Any], limits: dict[str, Any]) -> None:
    """Grow the engine container's `requests` and `limits` (in place) by the role's tiers:
    memory by the host tier, ephemeral storage (requested only) by the disk tier's volume."""
    tiers = spec.kv_tiers
    if tiers.host_bytes:
        # Without a request of its own, a container's request is its limit (the API server's
        # default): grow that, not nothing.
        requests["memory"] = _plus(requests.get("memory", limits.get("memory")), tiers.host_bytes)
        if "memory" in limits:
            limits["memory"] = _plus(limits["memory"], tiers.host_bytes)
    if tiers.disk_bytes:
        volume = disk_volume_bytes(tiers.disk_bytes)
        requests["ephemeral-storage"] = _plus(requests.get("ephemeral-storage"), volume)


def _plus(quantity: int | str | None, num_bytes: int) -> str:
    """A byte quantity (None: 0) plus `num_bytes`, as an exact quantity."""
    base = 0 if quantity is None else quantity_bytes(quantity)
    return format_bytes(base + num_bytes)
