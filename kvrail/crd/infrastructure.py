"""The parts of an `InferencePool` spec about where it runs and how it is protected: the
discovery and request planes' endpoints and credentials, and the pods' identity and hardening.
Assembled in `kvrail.crd.pool`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kvrail.crd.base import CrdModel


class EndpointSpec(CrdModel):
    """A service endpoint and the Secrets holding its credentials."""

    credentials_secret: str | None = Field(None, max_length=253)
    """A Secret with keys `username` and `password`, mounted as files. Optional."""
    ca_secret: str | None = Field(None, max_length=253)
    """A Secret with key `ca.crt`, the CA that signed the server's certificate. Optional."""


class EtcdSpec(EndpointSpec):
    """The etcd cluster of the discovery plane."""

    endpoints: list[Annotated[str, Field(pattern=r"^https?://[^/:]+:[0-9]+$")]] = Field(
        min_length=1, max_length=16
    )
    """Client URLs, `http(s)://host:port`."""


class NatsSpec(EndpointSpec):
    """The NATS server (with JetStream) of the request plane."""

    url: str = Field(pattern=r"^(nats|tls)://[^/]+:[0-9]+$", max_length=512)
    """`nats://host:port` or `tls://host:port`."""


class InfrastructureSpec(CrdModel):
    """Where the discovery and request planes are; unset uses the operator's defaults."""

    etcd: EtcdSpec | None = None
    """The etcd cluster. Optional."""
    nats: NatsSpec | None = None
    """The NATS server. Optional."""


class SecuritySpec(CrdModel):
    """Identity and hardening of the pool's pods."""

    service_account_name: str | None = Field(None, max_length=253)
    """ServiceAccount of every pod. Optional (the namespace's default)."""
    image_pull_secrets: list[str] = Field(default_factory=list, max_length=16)
    """Secrets to pull the image with."""
    run_as_user: int = Field(65532, ge=1)
    """UID of every container (never root). Default 65532."""
    api_keys_secret: str | None = Field(None, max_length=253)
    """A Secret with key `api-keys.yaml` mapping API keys to tenants; mounted in the router.
    Optional: without it the router accepts every request."""
    zero_kv_on_release: bool = False
    """Zero a KV block as soon as no request holds it, so nothing of a finished request stays
    in worker memory (or readable by a KV transfer peer). Prefix reuse then happens only between
    requests that run at the same time. Default false."""
