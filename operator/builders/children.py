"""Every child of a pool, in apply order, and the identities of those it must not have."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvrail.crd.pool import InferencePool, Role
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.deployment import build_deployment
from kvrail.operator.builders.gaie import (
    GAIE_API_VERSION,
    GAIE_KIND,
    build_epp_deployment,
    build_epp_service,
    build_gaie_pool,
    gaie_pool_name,
    inference_extension,
)
from kvrail.operator.builders.httproute import build_httproute
from kvrail.operator.builders.meta import config_name
from kvrail.operator.builders.networkpolicy import build_network_policy, network_policy_name
from kvrail.operator.builders.pdb import build_pdb
from kvrail.operator.builders.secret import build_infrastructure_secret, infrastructure_secret_name
from kvrail.operator.builders.service import build_router_service, build_worker_service
from kvrail.operator.builders.statefulset import build_statefulset

ROLES: tuple[Role, ...] = ("prefill", "decode")


class ChildRef(NamedTuple):
    """Identity of a child object within the pool's namespace."""

    api_version: str
    kind: str
    name: str


def build_children(
    pool: InferencePool, ctx: BuildContext, replicas: Mapping[Role, int] | None = None
) -> list[dict[str, Any]]:
    """All desired children: the operator's access to its servers (when the pool uses
    them) and the workers' NetworkPolicy first (no worker runs unprotected or without its
    credentials), then Services, workloads, budgets, in GAIE mode the endpoint picker (with a
    budget when it has more than one replica) and the GAIE InferencePool, and the route (to the
    GAIE pool only once it exists).

    `replicas` overrides the worker StatefulSets' sizes (see
    `kvrail.operator.autoscale.replicas`)."""
    sizes = replicas or {}
    roles = [r for r in ROLES if pool.role(r) is not None]
    out: list[dict[str, Any]] = []
    secret = build_infrastructure_secret(pool, ctx)
    if secret is not None:
        out.append(secret)
    if ctx.network_policies:
        out.append(build_network_policy(pool))
    out += [build_worker_service(pool, r) for r in roles]
    out.append(build_router_service(pool))
    out += [build_statefulset(pool, r, ctx, sizes.get(r)) for r in roles]
    out.append(build_deployment(pool, ctx))
    out += [build_pdb(pool, r) for r in roles]
    out.append(build_pdb(pool, "router"))
    gaie = inference_extension(pool)
    if gaie is not None:
        out += [build_epp_service(pool), build_epp_deployment(pool, ctx)]
        if gaie.epp_replicas > 1:  # one EPP may always be evicted: a budget would add nothing
            out.append(build_pdb(pool, "epp"))
        out.append(build_gaie_pool(pool))
    route = build_httproute(pool)
    if route is not None:
        out.append(route)
    return out


def ref(manifest: dict[str, Any]) -> ChildRef:
    return ChildRef(manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"])


def stale_children(pool: InferencePool, ctx: BuildContext) -> list[ChildRef]:
    """Children the pool may have had but must not have now (e.g. prefill after a switch to
    colocated mode, the HTTPRoute after the gateway is removed, the GAIE objects and their
    route after GAIE mode is turned off, the NetworkPolicy after the
    operator's were turned off, the infrastructure Secret once the pool names its own servers,
    the router's ConfigMap that earlier operators wrote); the handler deletes them."""
    every = _every_possible(pool, ctx)
    wanted = {ref(m) for m in build_children(pool, ctx)}
    return [r for r in every if r not in wanted]


def _every_possible(pool: InferencePool, ctx: BuildContext) -> list[ChildRef]:
    name = pool.metadata.name
    out = []
    for role in ROLES:
        child = f"{name}-{role}"
        out += [
            ChildRef("v1", "Service", child),
            ChildRef("apps/v1", "StatefulSet", child),
            ChildRef("policy/v1", "PodDisruptionBudget", child),
        ]
    template = pool.spec.model.chat_template
    if template is None or template.config_map_key_ref.name != config_name(pool):
        out.append(ChildRef("v1", "ConfigMap", config_name(pool)))  # never the user's template
    out.append(ChildRef("gateway.networking.k8s.io/v1", "HTTPRoute", f"{name}-router"))
    out += [
        ChildRef("v1", "Service", f"{name}-epp"),
        ChildRef("apps/v1", "Deployment", f"{name}-epp"),
        ChildRef("policy/v1", "PodDisruptionBudget", f"{name}-epp"),
        ChildRef(GAIE_API_VERSION, GAIE_KIND, gaie_pool_name(pool)),
        ChildRef("gateway.networking.k8s.io/v1", "HTTPRoute", gaie_pool_name(pool)),
    ]
    out.append(ChildRef("networking.k8s.io/v1", "NetworkPolicy", network_policy_name(pool)))
    if ctx.share_access:
        out.append(ChildRef("v1", "Secret", infrastructure_secret_name(pool)))
    return out
