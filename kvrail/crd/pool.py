"""The `InferencePool` API (`inferencepools.kvrail.dev/v1alpha1`): the source of `crds/`.

Fields are snake_case here and camelCase in YAML. Every field is documented by the docstring under
it; `kvrail.crd.gen` turns these models into the CRD's structural OpenAPI schema with defaults,
enums and the CEL rules declared next to the models. The models check types, enums and ranges;
rules spanning fields are CEL, enforced by the API server at `kubectl apply` and evaluated in unit
tests by `kvrail.testing.cel`.

What the model fingerprint covers (dtype, KV dtype, block size) lives once, in `spec.model`, so
prefill and decode cannot disagree on it; the tensor-parallel size (a role's `gpus`), also in the
fingerprint, is set per pool and a CEL rule requires the two to match.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvrail.crd.base import CrdModel, rule, rules, sub
from kvrail.crd.infrastructure import InfrastructureSpec, SecuritySpec
from kvrail.crd.spec import (
    PACKAGED_MODEL_NAMES,
    AutoscalingSpec,
    DisaggregationSpec,
    EngineSpec,
    ModelSpec,
    RoleSpec,
    RouterSpec,
    TopologySpec,
)
from kvrail.crd.status import InferencePoolStatus

GROUP: Final = "kvrail.dev"
VERSION: Final = "v1alpha1"
KIND: Final = "InferencePool"
PLURAL: Final = "inferencepools"
API_VERSION: Final = "kvrail.dev/v1alpha1"
MAX_POOL_NAME_LENGTH = 40
Role = Literal["prefill", "decode"]
VLLM_KV_LOAD_FAILURE_POLICIES: Final = ("recompute", "fail")
"""The values of vLLM's own `kv_load_failure_policy` (a vLLM pool cannot `reroute`)."""
FP8_KV_DTYPES: Final = ("float8_e4m3fn", "float8_e5m2")
"""The KV dtypes kvrail's CUDA kernels keep besides the weights' own."""
VLLM_KV_CACHE_DTYPES: Final = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
"""kvrail's KV dtypes that vLLM's `--kv-cache-dtype` can store other than the weights' dtype."""


MAX_KVRAIL_GPUS: Final = 8
"""Tensor-parallel ranks of kvrail's engine: one node's NVLink domain
(`kvrail.worker.parallel.layout.MAX_TENSOR_PARALLEL_SIZE`)."""


def _tp(role: str) -> str:
    """CEL for a role's tensor-parallel size."""
    return f"({role}.gpus == 0 ? 1 : {role}.gpus)"


def _cel_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _vllm_rule(expr: str, message: str, field_path: str) -> dict[str, str]:
    """A rule that holds for every engine but vLLM, and for vLLM when `expr` does."""
    return rule(f"self.engine.kind != 'vllm' || {expr}", message, field_path)


# What a vLLM pool cannot do, refused at apply rather than found when vLLM starts (or worse,
# silently ignored). `kvrail.vllm.serve`, which builds vLLM's command line, refuses the same.
_VLLM_RULES = (
    _vllm_rule(
        f"self.disaggregation.kvLoadFailurePolicy in {_cel_list(VLLM_KV_LOAD_FAILURE_POLICIES)}",
        "engine.kind vllm cannot reroute a failed KV load to another prefill worker: vLLM's own "
        f"kv_load_failure_policy knows only {' and '.join(VLLM_KV_LOAD_FAILURE_POLICIES)}",
        ".disaggregation.kvLoadFailurePolicy",
    ),
    _vllm_rule(
        "self.disaggregation.transferBackend == 'nixl'",
        "engine.kind vllm moves KV with vLLM's NIXL connector only: set "
        "disaggregation.transferBackend to nixl",
        ".disaggregation.transferBackend",
    ),
    _vllm_rule(
        f"!(self.model.source in {_cel_list(PACKAGED_MODEL_NAMES)})",
        "model.source names a model packaged for kvrail's own engine; engine.kind vllm needs "
        "a safetensors directory (e.g. under /models, see model.volumeClaim) or a model id "
        "vLLM can load",
        ".model.source",
    ),
    _vllm_rule(
        f"self.model.kvDtype in {_cel_list(['auto', *VLLM_KV_CACHE_DTYPES])} || "
        "self.model.kvDtype == self.model.dtype",
        "engine.kind vllm keeps the KV cache in the weights' dtype (auto) or in fp8 "
        f"({', '.join(VLLM_KV_CACHE_DTYPES)}): vLLM's --kv-cache-dtype has no other float type",
        ".model.kvDtype",
    ),
    _vllm_rule(
        "self.model.quantization != 'none'",
        "engine.kind vllm runs a checkpoint's weights as stored (quantization auto) or in fp8: "
        "it cannot run an FP8 checkpoint unquantized, so none is not offered",
        ".model.quantization",
    ),
    *(
        _vllm_rule(
            f"!has(self.{role}) || !has(self.{role}.kvTiers.disk)",
            "engine.kind vllm has no disk KV tier (its native offloading keeps KV in host "
            "memory only): remove kvTiers.disk, or use kvrail's engine",
            f".{role}.kvTiers.disk",
        )
        for role in ("decode", "prefill")
    ),
    *(
        _vllm_rule(
            f"self.disaggregation.mode == 'colocated' || !has(self.{role}) || "
            f"!has(self.{role}.kvTiers.host)",
            "engine.kind vllm offloads KV to host memory with its OffloadingConnector, which "
            "takes the place of the NIXL connector a disaggregated pool needs: a host tier on "
            "vLLM needs disaggregation.mode colocated",
            f".{role}.kvTiers.host",
        )
        for role in ("decode", "prefill")
    ),
    _vllm_rule(
        "!self.security.zeroKvOnRelease",
        "engine.kind vllm does not zero freed KV blocks: set security.zeroKvOnRelease to false",
        ".security.zeroKvOnRelease",
    ),
)

MAX_KV_TIER_GPUS: Final = 1
"""kvrail's engine keeps KV tiers on one rank for now (`kvrail.worker.engine.kv_tiers.build`
refuses more): raise both together."""
_KV_TIER_RULES = tuple(
    rule(
        f"self.engine.kind != 'kvrail' || !has(self.{role}) || "
        f"!has(self.{role}.kvTiers.host) || self.{role}.gpus <= {MAX_KV_TIER_GPUS}",
        f"kvrail's engine keeps KV tiers on one GPU per replica for now: kvTiers needs gpus "
        f"at most {MAX_KV_TIER_GPUS}",
        f".{role}.kvTiers.host",
    )
    for role in ("decode", "prefill")
)

_SPEC_RULES = rules(
    rule(
        "self.disaggregation.mode == 'colocated' || has(self.prefill)",
        "disaggregated mode needs a prefill pool",
        ".prefill",
        "FieldValueRequired",
    ),
    rule(
        "self.disaggregation.mode == 'disaggregated' || !has(self.prefill)",
        "colocated mode runs a single pool (decode); remove prefill",
        ".prefill",
        "FieldValueForbidden",
    ),
    rule(
        f"!has(self.prefill) || {_tp('self.prefill')} == {_tp('self.decode')}",
        "prefill and decode must use the same tensor-parallel size (gpus, 1 on CPU): it is part "
        "of the model fingerprint, and workers with different fingerprints never pair",
        ".prefill.gpus",
    ),
    rule(  # prefill.gpus equals decode.gpus (the rule above), so this bounds both
        f"self.engine.kind != 'kvrail' || self.decode.gpus <= {MAX_KVRAIL_GPUS}",
        f"kvrail's engine runs a replica's GPUs as tensor-parallel ranks of one pod on one "
        f"node: gpus must be at most {MAX_KVRAIL_GPUS}",
        ".decode.gpus",
    ),
    rule(
        "self.engine.kind != 'kvrail' || self.model.kvDtype == 'auto' || "
        "self.model.kvDtype == self.model.dtype || "
        f"self.model.kvDtype in {_cel_list(FP8_KV_DTYPES)} || "
        "(self.decode.gpus == 0 && (!has(self.prefill) || self.prefill.gpus == 0))",
        "kvrail's CUDA kernels read the KV cache in the weights' dtype (auto) or in FP8 "
        f"({', '.join(FP8_KV_DTYPES)}): another KV dtype runs on CPU pools only, in the float32 "
        "reference path",
        ".model.kvDtype",
    ),
    rule(
        "self.engine.kind != 'kvrail' || self.model.quantization != 'fp8' || "
        "self.model.dtype == 'bfloat16' || "
        "(self.decode.gpus == 0 && (!has(self.prefill) || self.prefill.gpus == 0))",
        "kvrail's FP8 weights on a GPU compute in bfloat16 (the FP8 GEMM's output type): set "
        "model.dtype to bfloat16",
        ".model.dtype",
    ),
    rule(
        "self.disaggregation.mode == 'colocated' || "
        "self.disaggregation.minRemotePrefillTokens < self.model.maxModelLen",
        "disaggregation.minRemotePrefillTokens must be below model.maxModelLen, "
        "or no prompt is ever prefilled remotely",
        ".disaggregation.minRemotePrefillTokens",
    ),
    rule(
        "!(self.topology.rdma == 'required' && self.disaggregation.transferBackend == 'local')",
        "the local transfer backend never uses RDMA: use nixl, or set topology.rdma to "
        "preferred or none",
        ".topology.rdma",
    ),
    rule(
        "!self.autoscaling.enabled || (has(self.decode.maxReplicas) && "
        "(!has(self.prefill) || has(self.prefill.maxReplicas)))",
        "autoscaling needs maxReplicas on every pool",
        ".autoscaling.enabled",
        "FieldValueRequired",
    ),
    rule(
        "self.engine.kind == 'kvrail' || !has(self.router.gateway) || "
        "!has(self.router.gateway.inferenceExtension) || "
        "!self.router.gateway.inferenceExtension.enabled",
        "router.gateway.inferenceExtension needs engine.kind kvrail: its endpoint picker names "
        "kvrail workers' HTTP fronts (a vLLM pool can sit behind a GAIE gateway with a picker "
        "that reads vLLM's metrics)",
        ".router.gateway.inferenceExtension.enabled",
    ),
    *_KV_TIER_RULES,
    *_VLLM_RULES,
)


class InferencePoolSpec(CrdModel):
    """Desired state of a pool: the model, the two worker pools and how they are wired."""

    model_config = ConfigDict(json_schema_extra=_SPEC_RULES)
    image: str | None = Field(None, max_length=512)
    """The kvrail image for every container; defaults to the operator's (`ghcr.io/kvrail/kvrail`
    at the operator's version)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Image pull policy. Default IfNotPresent."""
    model: ModelSpec = sub(ModelSpec)
    """The model and the settings every worker shares."""
    engine: EngineSpec = sub(EngineSpec)
    """The inference engine."""
    prefill: RoleSpec | None = None
    """The prefill pool; required in disaggregated mode, forbidden in colocated mode."""
    decode: RoleSpec = sub(RoleSpec)
    """The decode pool (in colocated mode, the only pool, running both phases)."""
    disaggregation: DisaggregationSpec = sub(DisaggregationSpec)
    """When prompts are prefilled remotely and what happens when a transfer fails."""
    topology: TopologySpec = sub(TopologySpec)
    """RDMA-aware placement."""
    router: RouterSpec = sub(RouterSpec)
    """The router."""
    autoscaling: AutoscalingSpec = sub(AutoscalingSpec)
    """Planner targets."""
    infrastructure: InfrastructureSpec = sub(InfrastructureSpec)
    """etcd and NATS endpoints and credentials."""
    security: SecuritySpec = sub(SecuritySpec)
    """Pod identity and hardening."""


class ObjectMeta(BaseModel):
    """The part of Kubernetes object metadata kvrail reads; the rest is kept as is."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferencePool(CrdModel):
    """A model served by a prefill pool, a decode pool and a router."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            rule(
                f"size(self.metadata.name) <= {MAX_POOL_NAME_LENGTH} && "
                "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                f"the pool name must be a DNS-1035 label of at most {MAX_POOL_NAME_LENGTH} "
                "characters: it prefixes Service and StatefulSet names",
            ),
            rule(
                "!has(self.spec.model.chatTemplate) || "
                "self.spec.model.chatTemplate.configMapKeyRef.name != "
                "self.metadata.name + '-config'",
                "model.chatTemplate cannot name the ConfigMap <pool>-config: the operator deletes "
                "it (the router configuration of earlier operators); name the template's "
                "ConfigMap otherwise",
                ".spec.model.chatTemplate.configMapKeyRef.name",
            ),
        )
    )
    api_version: Literal["kvrail.dev/v1alpha1"] = API_VERSION
    """`kvrail.dev/v1alpha1`."""
    kind: Literal["InferencePool"] = KIND
    """`InferencePool`."""
    metadata: ObjectMeta
    """Standard object metadata."""
    spec: InferencePoolSpec
    """Desired state. Required: the defaults alone describe no valid pool (disaggregated mode
    needs a prefill pool)."""
    status: InferencePoolStatus | None = None
    """Observed state, written by the operator."""

    def role(self, role: Role) -> RoleSpec | None:
        """The spec of one worker pool, or None when the pool does not run it."""
        return self.spec.prefill if role == "prefill" else self.spec.decode
