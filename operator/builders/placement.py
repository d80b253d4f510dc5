"""Where worker pods run and what hardware they ask for: pure functions of the pool.

- RDMA: `required` is a required node affinity on the RDMA label (plus the RDMA device resource,
  when named) and a UCX transport list without TCP, so a worker never silently falls back to TCP;
  `preferred` is a preferred node affinity with TCP allowed; `none` adds nothing.
- Co-location: prefill and decode prefer the same `colocationKey` domain (a rack, an NVLink
  clique), so KV transfers stay inside it. Preferred only: a full domain must not block a pool.
- Spread: replicas of one role spread over `spreadKey` (default: the node), best effort.
- Hardware: the role's memory and storage grown by its KV tiers, GPUs as `gpuResource` requests
  and limits, a toleration for the usual GPU taint, and
  the role's own node selector, so prefill and decode can use different GPU types.
"""

from __future__ import annotations

from typing import Any

from kvrail.crd.pool import InferencePool, Role
from kvrail.crd.spec import RoleSpec
from kvrail.operator.builders.meta import POOL_LABEL, ROLE_LABEL, selector_labels
from kvrail.operator.builders.tiers import add_tier_resources

NODE_AFFINITY_WEIGHT = 100
COLOCATION_WEIGHT = 50
IPC_LOCK = "IPC_LOCK"
"""RDMA registers (pins) memory, which needs the memlock capability."""


def affinity(pool: InferencePool, role: Role) -> dict[str, Any]:
    """Node affinity for RDMA and pod affinity toward the other role; `{}` when neither applies."""
    out: dict[str, Any] = {}
    node = _node_affinity(pool)
    if node:
        out["nodeAffinity"] = node
    peer = _peer(pool, role)
    if peer is not None:
        out["podAffinity"] = {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": COLOCATION_WEIGHT,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": selector_labels(pool, peer)},
                        "topologyKey": pool.spec.topology.colocation_key,
                    },
                }
            ]
        }
    return out


def topology_spread(pool: InferencePool, role: Role) -> list[dict[str, Any]]:
    """Spread same-role replicas over `spreadKey`, never blocking scheduling."""
    return [
        {
            "maxSkew": 1,
            "topologyKey": pool.spec.topology.spread_key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {POOL_LABEL: pool.metadata.name, ROLE_LABEL: role}},
        }
    ]


def resources(pool: InferencePool, spec: RoleSpec) -> dict[str, Any]:
    """Requests and limits: the role's own grown by its KV tiers (`builders.tiers`), its GPUs,
    and the RDMA device when required."""
    requests: dict[str, Any] = dict(spec.resources.requests)
    limits: dict[str, Any] = dict(spec.resources.limits)
    add_tier_resources(spec, requests, limits)
    extended: dict[str, int] = {}
    if spec.gpus:
        extended[spec.gpu_resource] = spec.gpus
    topology = pool.spec.topology
    if topology.rdma == "required" and topology.rdma_resource:
        extended[topology.rdma_resource] = topology.rdma_resource_count
    # Extended resources cannot be overcommitted: requests must equal limits.
    requests.update(extended)
    limits.update(extended)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def tolerations(spec: RoleSpec) -> list[dict[str, Any]]:
    """The role's tolerations, plus the `<gpuResource>:NoSchedule` taint GPU nodes usually carry."""
    out = [t.model_dump(mode="json", exclude_none=True) for t in spec.tolerations]
    if spec.gpus and not any(t.get("key") == spec.gpu_resource for t in out):
        out.append({"key": spec.gpu_resource, "operator": "Exists", "effect": "NoSchedule"})
    return out


def ucx_tls(pool: InferencePool, spec: RoleSpec) -> str:
    """`UCX_TLS` for a worker: no TCP when RDMA is required, no RDMA when it is `none`."""
    rdma = pool.spec.topology.rdma
    transports = {"required": ["rc", "ud"], "preferred": ["rc", "ud", "tcp"], "none": ["tcp"]}[rdma]
    transports += ["sm", "self"]
    if spec.gpus:
        transports += ["cuda_copy", "cuda_ipc"]
    return ",".join(transports)


def capabilities(pool: InferencePool) -> list[str]:
    """Linux capabilities a worker adds (everything else is dropped)."""
    return [IPC_LOCK] if pool.spec.topology.rdma != "none" else []


def _node_affinity(pool: InferencePool) -> dict[str, Any]:
    topology = pool.spec.topology
    term = {
        "matchExpressions": [
            {
                "key": topology.rdma_node_label,
                "operator": "In",
                "values": [topology.rdma_node_label_value],
            }
        ]
    }
    if topology.rdma == "required":
        return {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    if topology.rdma == "preferred":
        return {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": NODE_AFFINITY_WEIGHT, "preference": term}
            ]
        }
    return {}


def _peer(pool: InferencePool, role: Role) -> Role | None:
    if pool.spec.disaggregation.mode == "colocated":
        return None
    return "decode" if role == "prefill" else "prefill"
