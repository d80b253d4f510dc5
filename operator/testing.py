"""Test objects for the operator and the CRD: a valid base pool and mutations of it.

Validation and builder tests are tables of (mutation, expected); every case starts from
`pool_manifest()`, a small valid disaggregated pool, and changes one thing with `mutate`.
"""

from __future__ import annotations

import copy
from typing import Any

from kvrail.crd import API_VERSION, KIND, InferencePool

DELETE = object()
"""Pass as the value to `mutate` to remove a field."""


def pool_manifest(name: str = "tiny", namespace: str = "default") -> dict[str, Any]:
    """A minimal valid InferencePool manifest: disaggregated, one prefill and one decode replica."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"source": "smollm2", "dtype": "float32"}, "prefill": {}, "decode": {}},
    }


def mutate(manifest: dict[str, Any], *changes: tuple[str, Any]) -> dict[str, Any]:
    """A deep copy of `manifest` with each dotted path set to its value (or removed by DELETE).

    Missing parents are created: `mutate(m, ("spec.topology.rdma", "required"))`.
    """
    out = copy.deepcopy(manifest)
    for path, value in changes:
        *parents, leaf = path.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return out


def make_pool(
    manifest: dict[str, Any] | None = None, *, uid: str = "uid-1", generation: int = 1
) -> InferencePool:
    """Parse a manifest into a model, with the uid and generation the API server would set."""
    data = mutate(
        manifest if manifest is not None else pool_manifest(),
        ("metadata.uid", uid),
        ("metadata.generation", generation),
    )
    return InferencePool.model_validate(data)
