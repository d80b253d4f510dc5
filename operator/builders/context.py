"""What the builders need besides the pool: the operator's defaults, from its settings."""

from __future__ import annotations

from dataclasses import dataclass

from kvrail import __version__

DEFAULT_IMAGE = f"ghcr.io/kvrail/kvrail:{__version__}"


@dataclass(frozen=True, slots=True)
class BuildContext:
    """Operator-wide defaults a pool may override in `spec`.

    The etcd and NATS defaults name the in-cluster services the Helm chart can install; a pool
    without `spec.infrastructure` uses them. `network_policies` gives every pool a NetworkPolicy
    for its workers (`builders.networkpolicy`); off, the operator deletes those it made.
    """

    image: str = DEFAULT_IMAGE
    etcd_endpoints: tuple[str, ...] = ("http://kvrail-etcd.kvrail-system.svc:2379",)
    nats_url: str = "nats://kvrail-nats.kvrail-system.svc:4222"
    network_policies: bool = True

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("BuildContext.image must not be empty")
        if not self.etcd_endpoints:
            raise ValueError("BuildContext.etcd_endpoints needs at least one endpoint")
