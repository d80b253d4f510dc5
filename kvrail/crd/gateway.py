"""The parts of an `InferencePool` spec about the Gateway API: the router's HTTPRoute and the
opt-in Gateway API Inference Extension (GAIE) mode. Used by `RouterSpec` in `kvrail.crd.spec`.

In GAIE mode the operator renders, besides the pool's own router, an
`inference.networking.k8s.io/v1` `InferencePool` over the decode pods' HTTP fronts, kvrail's
endpoint picker (`kvrail.epp`) for it, and an HTTPRoute whose backend is that GAIE pool instead of
the router Service (docs/operator.md).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvrail.crd.base import CrdModel, Quantity, sub

FailureMode = Literal["FailClose", "FailOpen"]
"""GAIE's `endpointPickerRef.failureMode`: what the gateway does when the picker is down."""


class ParentRef(CrdModel):
    """The Gateway the router's HTTPRoute attaches to."""

    name: str = Field(min_length=1, max_length=253)
    """Gateway name."""
    namespace: str | None = Field(None, max_length=63)
    """Gateway namespace; defaults to the pool's."""
    section_name: str | None = Field(None, max_length=253)
    """A listener of the Gateway. Optional."""


Hostname = Annotated[
    str,
    Field(
        max_length=253,
        pattern=r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
    ),
]


class PickerResources(CrdModel):
    """CPU and memory of one endpoint picker replica."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Minimum resources, e.g. `{cpu: "1", memory: 1Gi}`."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources."""


class InferenceExtensionSpec(CrdModel):
    """Serve the pool behind a Gateway API Inference Extension gateway (GAIE v1).

    The platform installs GAIE's CRDs (`inferencepools.inference.networking.k8s.io`, v1) and a
    gateway that implements them; kvrail's chart does not. With `enabled`, the operator renders
    a GAIE `InferencePool` named `<pool>-gaie` selecting the decode pods, whose HTTP fronts
    (one per pod, port 8000) are its endpoints; kvrail's endpoint picker `<pool>-epp`; and the
    HTTPRoute `<pool>-gaie` to that GAIE pool. Without GAIE's CRD the pool is `Degraded`
    (`InferenceExtensionMissing`) until it is installed. kvrail's engine only (`engine.kind
    kvrail`): the picker names kvrail workers' fronts."""

    enabled: bool = False
    """Turn GAIE mode on. Default false: the HTTPRoute goes to the router Service."""
    failure_mode: FailureMode = "FailClose"
    """What the gateway does while the picker cannot be reached: `FailClose` (default) refuses
    the request, `FailOpen` sends it to a decode pod the gateway picks itself. Enforced by the
    gateway, not by kvrail; Envoy-based gateways fail open only before the body reached the
    picker (docs/epp.md)."""
    epp_replicas: int = Field(1, ge=0, le=16)
    """Endpoint picker replicas. Default 1. Each replica books load on its own, from the same
    etcd records and KV events. With more than one, a PodDisruptionBudget (`<pool>-epp`) lets a
    node drain evict one at a time."""
    num_endpoints: int = Field(1, ge=1, le=8)
    """Endpoints the picker names per request: the primary, then fallbacks. Default 1: Envoy AI
    Gateway routes through an `ORIGINAL_DST` cluster keyed on the header, which takes one
    `ip:port` and answers 503 to a list (docs/epp.md); more only for a gateway that takes
    GAIE's comma-separated fallbacks."""
    resources: PickerResources = sub(PickerResources)
    """CPU and memory of a picker replica."""
    tls_secret: str | None = Field(None, max_length=253)
    """A `kubernetes.io/tls` Secret (`tls.crt`, `tls.key`) in the pool's namespace that the
    picker serves on its ext_proc port, for a gateway that verifies it; re-read when the Secret
    is rotated. Optional: without it the picker makes a self-signed certificate when it starts,
    which GAIE's gateways accept without verifying it (docs/epp.md, "TLS")."""


class GatewaySpec(CrdModel):
    """Expose the pool through the Gateway API (an HTTPRoute): to the router Service, or in GAIE
    mode (`inferenceExtension`) to a GAIE InferencePool whose endpoint picker is kvrail's."""

    parent_ref: ParentRef
    """The Gateway to attach to."""
    hostnames: list[Hostname] = Field(default_factory=list, max_length=16)
    """Hostnames the route serves; empty serves the Gateway's."""
    inference_extension: InferenceExtensionSpec = sub(InferenceExtensionSpec)
    """Gateway API Inference Extension mode. Optional: off by default."""
