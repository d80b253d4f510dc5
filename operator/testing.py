"""Test objects for the operator and the CRD: a valid base pool and mutations of it.

Validation and builder tests are tables of (mutation, expected); every case starts from
`pool_manifest()`, a small valid disaggregated pool, and changes one thing with `mutate`.
"""

from __future__ import annotations

import copy
from typing import Any

from kvrail.crd.pool import API_VERSION, KIND, InferencePool

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


Change = tuple[str, Any]
COLOCATED: tuple[Change, ...] = (
    ("spec.prefill", DELETE),
    ("spec.disaggregation.mode", "colocated"),
)
VLLM: tuple[Change, ...] = (
    ("spec.engine.kind", "vllm"),
    ("spec.model.source", "/models/tiny"),
)
"""The base pool on vLLM (which cannot load kvrail's packaged model, so a directory)."""
LOAD_SCORER: dict[str, Any] = {"name": "load", "weight": 8}
SCORERS: list[dict[str, Any]] = [
    {"name": "prefix-cache", "weight": 1},
    LOAD_SCORER,
    {"name": "kv-utilization", "weight": 0},
]
"""The kv-aware profile weighed a pool's own way (`spec.router.scorers`)."""

# Manifests the CRD refuses, as (case, changes, path of the violation, a word of its message).
# Shared by the cel-python unit tests and the real API server tests: the path is where
# `kvrail.testing.cel` reports the violation (a leading dot; "" for the root), the word is in the
# message users see.
REFUSED: list[tuple[str, tuple[Change, ...], str, str]] = [
    (
        "replicas above max",
        (("spec.decode.replicas", 3), ("spec.decode.maxReplicas", 2)),
        ".spec.decode.replicas",
        "maxReplicas",
    ),
    (
        "min above replicas",
        (("spec.prefill.minReplicas", 2),),
        ".spec.prefill.minReplicas",
        "minReplicas",
    ),
    (
        "tensor parallel without gpus",
        (*COLOCATED, ("spec.decode.parallelism", {"tensor": 2})),
        ".spec.decode.parallelism.tensor",
        "gpus",
    ),
    (
        "gpus unequal to tensor parallel",
        (*COLOCATED, ("spec.decode.gpus", 2), ("spec.decode.parallelism", {"tensor": 4})),
        ".spec.decode.parallelism.tensor",
        "gpus",
    ),
    (
        "kvrail's engine on more than eight gpus",
        (*COLOCATED, ("spec.decode.gpus", 16)),
        ".spec.decode.gpus",
        "at most 8",
    ),
    (
        "batched tokens below sequences",
        (("spec.decode.maxNumBatchedTokens", 8), ("spec.decode.maxNumSeqs", 16)),
        ".spec.decode.maxNumBatchedTokens",
        "maxNumSeqs",
    ),
    (
        "prefill and decode tensor parallel differ",
        (("spec.prefill.gpus", 2), ("spec.decode.gpus", 1)),
        ".spec.prefill.gpus",
        "fingerprint",
    ),
    (
        "disaggregated without prefill",
        (("spec.prefill", DELETE),),
        ".spec.prefill",
        "needs a prefill",
    ),
    (
        "colocated with prefill",
        (("spec.disaggregation.mode", "colocated"),),
        ".spec.prefill",
        "remove prefill",
    ),
    (
        "threshold at max model length",
        (("spec.disaggregation.minRemotePrefillTokens", 4096),),
        ".spec.disaggregation.minRemotePrefillTokens",
        "maxModelLen",
    ),
    (
        "rdma resource without rdma required",
        (("spec.topology.rdmaResource", "rdma/hca"),),
        ".spec.topology.rdmaResource",
        "required",
    ),
    (
        "rdma required with the local backend",
        (("spec.topology.rdma", "required"), ("spec.disaggregation.transferBackend", "local")),
        ".spec.topology.rdma",
        "local",
    ),
    (
        "autoscaling without max replicas",
        (("spec.autoscaling.enabled", True), ("spec.decode.maxReplicas", 4)),
        ".spec.autoscaling.enabled",
        "maxReplicas",
    ),
    (
        "vllm rerouting a failed KV load",
        (*VLLM, ("spec.disaggregation.kvLoadFailurePolicy", "reroute")),
        ".spec.disaggregation.kvLoadFailurePolicy",
        "recompute and fail",
    ),
    (
        "vllm with the local backend",
        (*VLLM, ("spec.disaggregation.transferBackend", "local")),
        ".spec.disaggregation.transferBackend",
        "NIXL",
    ),
    (
        "vllm with the packaged model",
        (*VLLM, ("spec.model.source", "smollm2")),
        ".spec.model.source",
        "safetensors",
    ),
    (
        "vllm with a kv dtype unlike the weights",
        (*VLLM, ("spec.model.kvDtype", "bfloat16")),
        ".spec.model.kvDtype",
        "--kv-cache-dtype",
    ),
    (
        "kvrail with a float16 kv cache beside bfloat16 weights on gpus",
        (("spec.model.kvDtype", "float16"), ("spec.decode.gpus", 1)),
        ".spec.model.kvDtype",
        "CUDA kernels",
    ),
    (
        "kvrail with fp8 weights and float16 activations on gpus",
        (
            ("spec.model.quantization", "fp8"),
            ("spec.model.dtype", "float16"),
            ("spec.prefill.gpus", 2),
            ("spec.decode.gpus", 2),
        ),
        ".spec.model.dtype",
        "bfloat16",
    ),
    (
        "vllm told not to quantize",
        (*VLLM, ("spec.model.quantization", "none")),
        ".spec.model.quantization",
        "as stored",
    ),
    (
        "vllm zeroing released kv",
        (*VLLM, ("spec.security.zeroKvOnRelease", True)),
        ".spec.security.zeroKvOnRelease",
        "zero",
    ),
    ("engine image without vllm", (("spec.engine.image", "mine:1"),), ".spec.engine.image", "vllm"),
    (
        "engine args without vllm",
        (("spec.engine.extraArgs", ["--enforce-eager"]),),
        ".spec.engine.extraArgs",
        "vllm",
    ),
    (
        "scorers without kv-aware",
        (("spec.router.policy", "least-loaded"), ("spec.router.scorers", [LOAD_SCORER])),
        ".spec.router.scorers",
        "kv-aware",
    ),
    (
        "a scorer named twice",
        (("spec.router.scorers", [LOAD_SCORER, {"name": "load", "weight": 2}]),),
        ".spec.router.scorers",
        "once",
    ),
    (
        "scorers all weighing 0",
        (("spec.router.scorers", [{"name": "load", "weight": 0}]),),
        ".spec.router.scorers",
        "above 0",
    ),
    ("pool name too long", (("metadata.name", "p" * 41),), "", "40"),
    ("pool name starting with a digit", (("metadata.name", "8b"),), "", "DNS-1035"),
    ("pool name with a dot", (("metadata.name", "a.b"),), "", "DNS-1035"),
]

# Manifests the CRD accepts, as (case, changes).
ACCEPTED: list[tuple[str, tuple[Change, ...]]] = [
    ("the base pool", ()),
    ("kv-aware with its own scorers, one left out at 0", (("spec.router.scorers", SCORERS),)),
    (
        "least-loaded with an empty scorer list",
        (("spec.router.policy", "least-loaded"), ("spec.router.scorers", [])),
    ),
    ("colocated without prefill", COLOCATED),
    (
        "colocated threshold may exceed max length",
        (*COLOCATED, ("spec.disaggregation.minRemotePrefillTokens", 10**6)),
    ),
    (
        "replicas within min and max",
        (
            ("spec.decode.minReplicas", 1),
            ("spec.decode.replicas", 2),
            ("spec.decode.maxReplicas", 3),
        ),
    ),
    ("prefill scaled to zero", (("spec.prefill.replicas", 0), ("spec.prefill.minReplicas", 0))),
    (
        "eight-GPU tensor parallel on both pools",
        (
            ("spec.prefill.gpus", 8),
            ("spec.prefill.parallelism", {"tensor": 8}),
            ("spec.decode.gpus", 8),
            ("spec.decode.parallelism", {"tensor": 8}),
        ),
    ),
    ("gpus alone set tensor parallelism", (("spec.prefill.gpus", 4), ("spec.decode.gpus", 4))),
    ("a cpu prefill pool with a one-gpu decode pool", (("spec.decode.gpus", 1),)),
    ("vllm on sixteen gpus", (*VLLM, ("spec.prefill.gpus", 16), ("spec.decode.gpus", 16))),
    (
        "rdma required with a device resource",
        (("spec.topology.rdma", "required"), ("spec.topology.rdmaResource", "rdma/hca")),
    ),
    (
        "local backend without rdma",
        (("spec.topology.rdma", "none"), ("spec.disaggregation.transferBackend", "local")),
    ),
    (
        "autoscaling with max replicas on both pools",
        (
            ("spec.autoscaling.enabled", True),
            ("spec.decode.maxReplicas", 4),
            ("spec.prefill.maxReplicas", 2),
        ),
    ),
    ("a 40-character name", (("metadata.name", "p" * 40),)),
    ("a vllm pool", VLLM),
    ("a colocated vllm pool", (*VLLM, *COLOCATED)),
    (
        "vllm with its image, arguments, an fp8 cache and the fail policy",
        (
            *VLLM,
            ("spec.engine.image", "vllm/vllm-openai:custom"),
            ("spec.engine.extraArgs", ["--gpu-memory-utilization", "0.85"]),
            ("spec.model.kvDtype", "float8_e4m3fn"),
            ("spec.disaggregation.kvLoadFailurePolicy", "fail"),
        ),
    ),
    (
        "kvrail with fp8 weights and kv cache on cpu",
        (("spec.model.kvDtype", "float8_e5m2"), ("spec.model.quantization", "fp8")),
    ),
    (
        "kvrail with fp8 weights and kv cache on gpus",
        (
            ("spec.model.dtype", "bfloat16"),
            ("spec.model.kvDtype", "float8_e4m3fn"),
            ("spec.model.quantization", "fp8"),
            ("spec.prefill.gpus", 1),
            ("spec.decode.gpus", 1),
        ),
    ),
    (
        "kvrail with float16 activations and an fp8 kv cache on gpus",
        (
            ("spec.model.dtype", "float16"),
            ("spec.model.kvDtype", "float8_e5m2"),
            ("spec.prefill.gpus", 1),
            ("spec.decode.gpus", 1),
        ),
    ),
    ("vllm with fp8 weights", (*VLLM, ("spec.model.quantization", "fp8"))),
    (
        "kvrail with a kv dtype equal to the weights' on gpus",
        (
            ("spec.model.dtype", "bfloat16"),
            ("spec.model.kvDtype", "bfloat16"),
            ("spec.prefill.gpus", 1),
            ("spec.decode.gpus", 1),
        ),
    ),
    ("vllm with a kv dtype equal to the weights'", (*VLLM, ("spec.model.kvDtype", "float32"))),
    ("vllm with a model id", (*VLLM, ("spec.model.source", "Qwen/Qwen2.5-0.5B-Instruct"))),
]
