"""Reconcile one pool: apply every desired child, delete stale ones, read back the workloads.

Idempotent and level-based: the same pool applied twice changes nothing the second time (server-
side apply of identical manifests is a no-op). Errors are sorted for Kopf: a refused manifest or
a missing kind is permanent until the spec changes (`ApplyRefusedError`), except GAIE's
InferencePool, which the platform may install later (`InferenceExtensionMissingError`);
everything else (timeouts, 5xx, 429, conflicts) is retried by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kubernetes.dynamic.exceptions import DynamicApiError

from kvrail.crd.pool import InferencePool, Role
from kvrail.operator.autoscale.replicas import planner_owns_replicas, worker_replicas
from kvrail.operator.builders.children import build_children, stale_children
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.gaie import GAIE_API_VERSION, GAIE_KIND
from kvrail.operator.builders.meta import Component, child_name
from kvrail.operator.k8s import KindNotServedError
from kvrail.operator.status import Workload, observe

PERMANENT_STATUSES = frozenset({400, 403, 422})
WORKLOAD_KINDS: dict[Component, tuple[str, str]] = {
    "prefill": ("apps/v1", "StatefulSet"),
    "decode": ("apps/v1", "StatefulSet"),
    "router": ("apps/v1", "Deployment"),
    "epp": ("apps/v1", "Deployment"),  # GAIE mode's endpoint picker
}


class Reader(Protocol):
    """Reading objects back (implemented by `kvrail.operator.k8s.Kube`)."""

    def get(
        self, api_version: str, kind: str, name: str, namespace: str
    ) -> dict[str, Any] | None: ...


class Cluster(Reader, Protocol):
    """What reconciling needs from the API (implemented by `kvrail.operator.k8s.Kube`)."""

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]: ...
    def delete(self, api_version: str, kind: str, name: str, namespace: str) -> bool: ...


class ApplyRefusedError(Exception):
    """The API server refused a child for a reason retrying will not fix."""


class InferenceExtensionMissingError(ApplyRefusedError):
    """GAIE mode is on but the API server does not serve GAIE's InferencePool: the platform has
    not installed its CRD. Retried slowly, so that installing the CRD is enough."""


@dataclass(frozen=True, slots=True)
class Outcome:
    applied: int
    deleted: list[str]


def reconcile(cluster: Cluster, pool: InferencePool, ctx: BuildContext) -> Outcome:
    """Apply all children in order, then delete those the spec no longer wants.

    While the planner is in charge of the worker sizes, the StatefulSets keep the replicas they
    have (see `kvrail.operator.autoscale.replicas`): a spec edit never undoes a scaling decision."""
    namespace = pool.metadata.namespace
    live = live_replicas(cluster, pool) if planner_owns_replicas(pool) else {}
    children = build_children(pool, ctx, worker_replicas(pool, live))
    for manifest in children:
        try:
            cluster.apply(manifest)
        except KindNotServedError as err:
            if manifest["apiVersion"] == GAIE_API_VERSION:
                raise InferenceExtensionMissingError(
                    f"router.gateway.inferenceExtension is enabled but the API server does not "
                    f"serve {GAIE_KIND}.{GAIE_API_VERSION}: install the Gateway API Inference "
                    f"Extension's CRDs (v1); the GAIE InferencePool, its HTTPRoute and the "
                    f"removal of stale children wait until then"
                ) from err
            raise ApplyRefusedError(
                f"{manifest['kind']} {manifest['metadata']['name']}: {err}"
            ) from err
        except DynamicApiError as err:
            if err.status in PERMANENT_STATUSES:
                name = f"{manifest['kind']} {manifest['metadata']['name']}"
                raise ApplyRefusedError(f"{name} refused ({err.status}): {err.summary()}") from err  # type: ignore[no-untyped-call]
            raise
    deleted = []
    for ref in stale_children(pool, ctx):
        if cluster.delete(ref.api_version, ref.kind, ref.name, namespace):
            deleted.append(f"{ref.kind}/{ref.name}")
    return Outcome(applied=len(children), deleted=deleted)


def live_replicas(cluster: Reader, pool: InferencePool) -> dict[Role, int | None]:
    """The worker StatefulSets' `spec.replicas` now (None where one does not exist)."""
    out: dict[Role, int | None] = {}
    for role in ("prefill", "decode"):
        if pool.role(role) is None:
            continue
        obj = cluster.get("apps/v1", "StatefulSet", child_name(pool, role), pool.metadata.namespace)
        out[role] = None if obj is None else int(obj.get("spec", {}).get("replicas", 1))
    return out


def observe_workloads(cluster: Reader, pool: InferencePool) -> dict[Component, Workload | None]:
    """The pool's StatefulSets and Deployments as the API server reports them."""
    out: dict[Component, Workload | None] = {}
    for component, (api_version, kind) in WORKLOAD_KINDS.items():
        obj = cluster.get(api_version, kind, child_name(pool, component), pool.metadata.namespace)
        out[component] = observe(obj)
    return out
