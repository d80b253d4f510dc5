"""Names, labels, owner references and the model hash shared by every child of a pool."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from kvrail import __version__
from kvrail.crd.pool import API_VERSION, KIND, InferencePool

Component = Literal["prefill", "decode", "router", "epp"]

POOL_LABEL = "kvrail.dev/pool"
ROLE_LABEL = "kvrail.dev/role"
MODEL_HASH_LABEL = "kvrail.dev/model-hash"
WORKER_PORT = 8080
"""Health and metrics port of a worker (`/readyz`, `/livez`, `/metrics`: `kvrail.worker.health`)."""
WORKER_READY_PATH = "/readyz"
WORKER_LIVE_PATH = "/livez"
ROUTER_PORT = 8000
"""OpenAI API, health and metrics port of the router (`kvrail.router.app`)."""
ROUTER_READY_PATH = "/ready"
"""200 once the router knows a ready decode worker, 503 before."""
ROUTER_LIVE_PATH = "/health"
ROUTER_ONLY_MODEL_FIELDS = frozenset(
    {"volume_claim", "served_name", "chat_template", "tool_call_parser", "reasoning_parser"}
)
"""`spec.model` fields outside the model hash: where the weights are mounted, the name clients
send, and how the router chats with the model. Changing them never rolls the workers, and a
field added here keeps every existing pool's hash (a pool's workers roll when it changes)."""


def child_name(pool: InferencePool, component: Component) -> str:
    """`<pool>-prefill`, `<pool>-decode`, `<pool>-router`: workloads, Services and PDBs."""
    return f"{pool.metadata.name}-{component}"


def config_name(pool: InferencePool) -> str:
    """The router's ConfigMap that earlier operators wrote (the router now reads its environment
    alone); the operator deletes it as a stale child."""
    return f"{pool.metadata.name}-config"


def selector_labels(pool: InferencePool, component: Component) -> dict[str, str]:
    """The immutable selector of a workload: pool and role only."""
    return {POOL_LABEL: pool.metadata.name, ROLE_LABEL: component}


def labels(pool: InferencePool, component: Component | None = None) -> dict[str, str]:
    """Recommended `app.kubernetes.io/*` labels plus `kvrail.dev/pool` (and `kvrail.dev/role`)."""
    out = {
        "app.kubernetes.io/name": "kvrail",
        "app.kubernetes.io/instance": pool.metadata.name,
        "app.kubernetes.io/part-of": "kvrail",
        "app.kubernetes.io/managed-by": "kvrail-operator",
        "app.kubernetes.io/version": __version__,
        POOL_LABEL: pool.metadata.name,
    }
    if component is not None:
        out["app.kubernetes.io/component"] = component
        out[ROLE_LABEL] = component
    return out


def owner_reference(pool: InferencePool) -> dict[str, Any]:
    """Makes the pool the controller of a child, so deleting the pool deletes its children."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pool.metadata.name,
        "uid": pool.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(pool: InferencePool, name: str, component: Component | None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": pool.metadata.namespace,
        "labels": labels(pool, component),
        "ownerReferences": [owner_reference(pool)],
    }


def short_hash(data: Any) -> str:
    """12 hex characters of sha256 over canonical JSON."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def model_hash(pool: InferencePool) -> str:
    """A hash of everything in the spec the model fingerprint depends on.

    Both worker pools carry it as a pod label, so a model change shows as a new value on every
    new pod; the workers' own fingerprint check keeps old and new pods from pairing mid-roll.
    """
    spec = pool.spec
    return short_hash(
        {
            "model": spec.model.model_dump(mode="json", exclude=set(ROUTER_ONLY_MODEL_FIELDS)),
            "engine": spec.engine.kind,
            "tensor": spec.decode.tensor_parallel_size,
        }
    )
