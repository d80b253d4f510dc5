"""What the builders need besides the pool: the operator's defaults, from its settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrail import __version__

DEFAULT_IMAGE = f"ghcr.io/kvrail/kvrail:{__version__}"


@dataclass(frozen=True, slots=True)
class SharedAccess:
    """The operator's own access to one of its default servers (etcd or NATS): what a pool that
    names no server of its own is given, in a Secret of its namespace (`builders.secret`)."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_pem: str | None = None
    """The CA certificate (PEM) the server's TLS certificate verifies against."""

    def __bool__(self) -> bool:
        return bool(self.username or self.password or self.ca_pem)


@dataclass(frozen=True, slots=True)
class BuildContext:
    """Operator-wide defaults a pool may override in `spec`.

    The etcd and NATS defaults name the in-cluster services the Helm chart can install; a pool
    without `spec.infrastructure` uses them, with the operator's own credentials and CAs when
    `share_access` is on and it has any (`etcd_access`, `nats_access`). `network_policies` gives
    every pool a NetworkPolicy for its workers (`builders.networkpolicy`); off, the operator
    deletes those it made.
    """

    image: str = DEFAULT_IMAGE
    etcd_endpoints: tuple[str, ...] = ("http://kvrail-etcd.kvrail-system.svc:2379",)
    nats_url: str = "nats://kvrail-nats.kvrail-system.svc:4222"
    network_policies: bool = True
    share_access: bool = False
    """Give pools the operator's access in `<pool>-infrastructure` (and delete that Secret when a
    pool no longer needs it); off, the operator touches no Secret (and has no RBAC for any)."""
    etcd_access: SharedAccess = field(default_factory=SharedAccess)
    """Credentials and CA for `etcd_endpoints`; empty: pools get the endpoints alone."""
    nats_access: SharedAccess = field(default_factory=SharedAccess)

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("BuildContext.image must not be empty")
        if not self.etcd_endpoints:
            raise ValueError("BuildContext.etcd_endpoints needs at least one endpoint")
