"""A worker pool's KV tiers below the GPU: pinned host memory and a local disk (`kvTiers` of a
role). Assembled into `kvrail.crd.spec.RoleSpec`.

Full KV blocks the GPU evicts are written behind to the host tier, and from there to the disk
tier; a prefix found in either is loaded back instead of recomputed. Sizes are Kubernetes
quantities of bytes per replica (pod): the operator adds the host tier to the worker
container's memory request and limit (pinned memory counts against the pod) and gives the disk
tier an `emptyDir` of its size. A size of 0 turns a tier off.

Bounds are CEL with the Kubernetes quantity library (`quantity()`, `isQuantity()`; API servers
1.29 and later), evaluated in unit tests by `kvrail.testing.cel`, and checked again by these
models for callers that do not come through the API server.
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from kvrail.crd.base import CrdModel, rule, rules
from kvrail.crd.quantity import BYTES_PATTERN, quantity_bytes

MIN_TIER: Final = "1Mi"
"""The smallest tier that is not off: a smaller one holds hardly a block."""
MAX_HOST_TIER: Final = "16Ti"
"""The largest host tier: more host memory than any one node has."""
MAX_DISK_TIER: Final = "1Pi"
"""The largest disk tier."""
RESERVED_PATHS: Final = ("/tmp", "/dev", "/models", "/var/cache/kvrail", "/var/run/secrets")
"""Where a worker pod mounts something else (scratch, shared memory, weights, credentials): a
disk tier may be neither one of them nor under one. `kvrail.operator.builders.pod` mounts them."""


def _bounded(maximum: str) -> AfterValidator:
    def check(value: str) -> str:
        num_bytes = quantity_bytes(value)
        if num_bytes and not quantity_bytes(MIN_TIER) <= num_bytes <= quantity_bytes(maximum):
            raise ValueError(f"{value} is not 0 (off) or from {MIN_TIER} to {maximum}")
        return value

    return AfterValidator(check)


def _size_rule(maximum: str) -> dict[str, str]:
    q = "quantity(self.size)"
    return rule(
        f"!isQuantity(self.size) || {q}.compareTo(quantity('0')) == 0 || "
        f"({q}.compareTo(quantity('{MIN_TIER}')) >= 0 && "
        f"{q}.compareTo(quantity('{maximum}')) <= 0)",
        f"size must be 0 (off) or from {MIN_TIER} to {maximum}",
        ".size",
    )


def _positive(size: str) -> str:
    """CEL: a tier's size, known to be a quantity, above 0."""
    return f"quantity({size}).isGreaterThan(quantity('0'))"


HostTierSize = Annotated[str, Field(max_length=32, pattern=BYTES_PATTERN), _bounded(MAX_HOST_TIER)]
DiskTierSize = Annotated[str, Field(max_length=32, pattern=BYTES_PATTERN), _bounded(MAX_DISK_TIER)]


class HostTierSpec(CrdModel):
    """Pinned host memory holding the KV blocks the GPU evicted."""

    model_config = ConfigDict(json_schema_extra=rules(_size_rule(MAX_HOST_TIER)))
    size: HostTierSize
    """Bytes of host memory per replica, as a quantity (e.g. `64Gi`): 0 (no host tier) or 1Mi
    to 16Ti. Added to the worker container's memory request and limit. Useful only when several
    times the replica's GPU KV pool: see the sizing rule in docs/kv-tiers.md."""

    @property
    def num_bytes(self) -> int:
        return quantity_bytes(self.size)


class DiskTierSpec(CrdModel):
    """A local disk (NVMe) holding the KV blocks the host tier evicted."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            _size_rule(MAX_DISK_TIER),
            rule(
                "!self.path.matches('/[.][.]?(/|$)') && !self.path.contains('//')",
                "path must be a normalised absolute directory (no //, . or ..) other than /",
                ".path",
            ),
            rule(
                "!["
                + ", ".join(f"'{p}'" for p in RESERVED_PATHS)
                + "].exists(p, self.path == p || self.path.startsWith(p + '/'))",
                "path must not be, or be under, a directory the worker pod mounts already: "
                + ", ".join(RESERVED_PATHS),
                ".path",
            ),
        )
    )
    path: str = Field(min_length=2, max_length=256, pattern=r"^/.*[^/]$")
    """The directory of the tier's files in the worker container: an absolute path (e.g.
    `/var/lib/kvrail/kv`), mounted from an `emptyDir` of `size`. Files left there by an earlier
    container of the same pod are validated and checksummed before use, never trusted."""
    size: DiskTierSize
    """Bytes the tier may hold per replica, as a quantity (e.g. `500Gi`): 0 (no disk tier) or
    1Mi to 1Pi. The pod requests this much ephemeral storage, plus headroom for the tier's own
    bookkeeping (`kvrail.operator.builders.tiers`)."""

    @field_validator("path")
    @classmethod
    def _path(cls, path: str) -> str:
        parts = path.split("/")[1:]
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{path} is not a normalised absolute directory")
        if any(path == p or path.startswith(p + "/") for p in RESERVED_PATHS):
            raise ValueError(f"{path} is, or is under, a directory the worker pod mounts already")
        return path

    @property
    def num_bytes(self) -> int:
        return quantity_bytes(self.size)


class KvTiersSpec(CrdModel):
    """The KV tiers below the GPU of each replica of a role. Optional: none by default."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            rule(
                "!has(self.disk) || !isQuantity(self.disk.size) || !"
                + _positive("self.disk.size")
                + " || (has(self.host) && isQuantity(self.host.size) && "
                + _positive("self.host.size")
                + ")",
                "a disk tier is fed by the host tier's evictions: set host.size above 0",
                ".disk",
                "FieldValueRequired",
            ),
        )
    )
    host: HostTierSpec | None = None
    """Pinned host memory below the GPU. Optional."""
    disk: DiskTierSpec | None = None
    """A local disk below the host tier; needs `host`. Optional. Not with engine kind `vllm`."""

    @model_validator(mode="after")
    def _disk_needs_host(self) -> KvTiersSpec:
        if self.disk_bytes and not self.host_bytes:
            raise ValueError("a disk tier is fed by the host tier's evictions: set host.size")
        return self

    @property
    def host_bytes(self) -> int:
        """The host tier's bytes, 0 without one."""
        return self.host.num_bytes if self.host is not None else 0

    @property
    def disk_bytes(self) -> int:
        """The disk tier's bytes, 0 without one."""
        return self.disk.num_bytes if self.disk is not None else 0
