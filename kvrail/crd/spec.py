"""The parts of an `InferencePool` spec: model, engine, worker pools, disaggregation, topology,
router and autoscaling (infrastructure and security: `kvrail.crd.infrastructure`). Assembled in
`kvrail.crd.pool`.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import ConfigDict, Field

from kvrail.crd.base import CrdModel, Quantity, rule, rules, sub
from kvrail.crd.chat import ChatTemplateSpec, ReasoningParser, ToolCallParser
from kvrail.crd.gateway import GatewaySpec
from kvrail.crd.tiers import KvTiersSpec

DType = Literal["float32", "float16", "bfloat16"]
KvDType = Literal["auto", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
WeightQuantization = Literal["auto", "none", "fp8"]
# Enums shared with kvrail.settings, which the operator fills from these fields.
DisaggregationMode = Literal["disaggregated", "colocated"]
KvLoadFailurePolicy = Literal["recompute", "fail", "reroute"]
TransferBackend = Literal["nixl", "local"]
RdmaMode = Literal["required", "preferred", "none"]
RouterPolicy = Literal["kv-aware", "least-loaded", "round-robin"]
ScorerName = Literal["prefix-cache", "load", "kv-utilization"]
"""The router's scorers (`kvrail.router.policy.SCORERS`), each a cost a weight multiplies."""
BlockSize = Literal[8, 16, 32, 64, 128]
"""Tokens per KV block a pool may use: the one range, shared by the API and `kvrail.settings`."""
DEFAULT_BLOCK_SIZE: Final = 16
DEFAULT_MAX_NUM_SEQS: Final = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS: Final = 8192
"""The engine limits' defaults, here once: the API's, `Settings`' and so the engine's."""
PACKAGED_MODEL_NAMES: Final = ("smollm2",)
"""The models a Python package ships for kvrail's own engine, by name (`kvrail.model_files`
describes each; a test keeps the two in step). Named here so the API package imports nothing
above it."""


class ModelSpec(CrdModel):
    """The model served, the settings every worker of the pool must share (fingerprint), and
    how the router chats with it (template and parsers: the router's alone)."""

    source: str = Field("smollm2", min_length=1, max_length=512)
    """A packaged model name (`smollm2`), a `.gguf` file or a safetensors directory in the image or
    under `/models` (see `volumeClaim`); kvrail never downloads from a hub. With engine kind
    `vllm`: a safetensors directory, or a model id vLLM loads itself. Default `smollm2`."""
    revision: str | None = Field(None, max_length=128)
    """An opaque revision of the weights; changing it rolls both pools. Optional."""
    served_name: str | None = Field(None, max_length=256)
    """The model name clients send to the OpenAI API. Defaults to the source's own name."""
    dtype: DType = "bfloat16"
    """Compute dtype of the weights and activations: float32, float16 or bfloat16 (default)."""
    kv_dtype: KvDType = "auto"
    """Dtype of the KV cache; `auto` (default) uses `dtype`. Part of the fingerprint. kvrail's
    engine keeps any of these on CPU pools and `dtype` or FP8 (`float8_e4m3fn`, `float8_e5m2`,
    with a scale of 1; GPUs of compute capability 8.9 or later) on GPU pools; vLLM's, `dtype` or
    FP8."""
    quantization: WeightQuantization = "auto"
    """Weights: `auto` (default: the checkpoint's own, FP8 for an FP8 checkpoint), `none` or
    `fp8` (e4m3, a scale per output row; a float checkpoint is quantized at load). Part of the
    fingerprint. kvrail's engine runs FP8 weights on GPUs of compute capability 8.9 or later
    with `dtype` bfloat16, and on CPU pools (a float32 reference, slower than float32); vLLM's
    with `--quantization fp8`."""
    block_size: BlockSize = DEFAULT_BLOCK_SIZE
    """Tokens per KV block: 8, 16 (default), 32, 64 or 128. Part of the fingerprint."""
    max_model_len: int = Field(4096, ge=16, le=1_048_576)
    """Longest prompt plus completion, in tokens. Default 4096."""
    volume_claim: str | None = Field(None, max_length=253)
    """A PersistentVolumeClaim holding the weights, mounted read-only at `/models`. Optional."""
    chat_template: ChatTemplateSpec | None = None
    """A Jinja chat template used instead of the model's, e.g. one that renders tools for a
    model whose own ignores them. Optional. The router's alone, as the parsers below: changing
    any of the three rolls the router, never the workers (with either engine)."""
    tool_call_parser: ToolCallParser = "auto"
    """The format of the model's tool calls: `hermes`, `llama3_json`, `mistral`, or `auto`
    (default), read from the chat template (docs/router.md, Tools)."""
    reasoning_parser: ReasoningParser = "auto"
    """`think` returns `<think>` reasoning apart from the answer, `none` does not; `auto`
    (default): `think` when the chat template writes both tags."""


EngineKind = Literal["kvrail", "vllm"]


class EngineSpec(CrdModel):
    """The inference engine the workers run."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            rule(
                "self.kind == 'vllm' || !has(self.image)",
                "engine.image is the vLLM image: set it only with engine.kind vllm "
                "(the kvrail image is spec.image)",
                ".image",
                "FieldValueForbidden",
            ),
            rule(
                "self.kind == 'vllm' || !has(self.extraArgs) || size(self.extraArgs) == 0",
                "engine.extraArgs are passed to `vllm serve`: set them only with engine.kind vllm",
                ".extraArgs",
                "FieldValueForbidden",
            ),
        )
    )
    kind: EngineKind = "kvrail"
    """`kvrail` (default): kvrail's own engine. `vllm`: each worker pod runs `vllm serve` with
    vLLM's NIXL connector, beside a kvrail agent that registers it for the router."""
    image: str | None = Field(None, min_length=1, max_length=512)
    """The vLLM image of the `engine` container; only with kind `vllm`. Defaults to the
    operator's (`vllm/vllm-openai` at a tested version). A CPU pool needs a CPU build of vLLM."""
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, max_length=64
    )
    """Arguments appended verbatim to `vllm serve`, after the ones kvrail sets (a repeated flag
    overrides kvrail's); only with kind `vllm`. E.g. `["--gpu-memory-utilization", "0.85"]`."""


class Parallelism(CrdModel):
    """How one replica spreads the model over its GPUs."""

    tensor: int | None = Field(None, ge=1, le=64)
    """Tensor-parallel size: one rank per GPU of the replica, so it is `gpus` (1 on a CPU pool),
    which is also its default; when set it must equal that. Part of the model fingerprint."""


class ResourceRequirements(CrdModel):
    """Extra container resources (CPU, memory); GPUs are set by `gpus`."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Minimum resources, e.g. `{cpu: "4", memory: 16Gi}`."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources."""


class Toleration(CrdModel):
    """A Kubernetes toleration, for tainted (for example GPU) nodes."""

    key: str | None = None
    """Taint key; empty with operator Exists tolerates everything."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """`Equal` (default) or `Exists`."""
    value: str | None = None
    """Taint value, with operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate; empty tolerates all effects."""


class EnvVar(CrdModel):
    """An extra environment variable, for example UCX tuning."""

    name: str = Field(min_length=1, max_length=256)
    """Variable name."""
    value: str = ""
    """Variable value."""


class RoleSpec(CrdModel):
    """One worker pool (prefill or decode): size, hardware, batching and placement."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            rule(
                "!has(self.minReplicas) || self.minReplicas <= self.replicas",
                "minReplicas must not exceed replicas",
                ".minReplicas",
            ),
            rule(
                "!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
                "replicas must not exceed maxReplicas",
                ".replicas",
            ),
            rule(
                "!has(self.parallelism.tensor) || "
                "self.parallelism.tensor == (self.gpus == 0 ? 1 : self.gpus)",
                "parallelism.tensor must equal gpus (and be 1 on a CPU pool): each GPU of a "
                "replica runs one tensor-parallel rank",
                ".parallelism.tensor",
            ),
            rule(
                "self.maxNumBatchedTokens >= self.maxNumSeqs",
                "maxNumBatchedTokens must be at least maxNumSeqs",
                ".maxNumBatchedTokens",
            ),
        )
    )
    replicas: int = Field(1, ge=0, le=1024)
    """Desired replicas (the planner changes it when autoscaling). Default 1."""
    min_replicas: int | None = Field(None, ge=0, le=1024)
    """Lower bound for the planner. Optional; must not exceed `replicas`."""
    max_replicas: int | None = Field(None, ge=0, le=1024)
    """Upper bound for the planner; required when autoscaling. Optional."""
    gpus: int = Field(0, ge=0, le=64)
    """GPUs per replica; 0 (default) runs on CPU. N GPUs make one pod on one node whose model is
    split over N tensor-parallel ranks, one process per GPU (TP=N; at most 8 with kvrail's
    engine). The model must split over N ranks (N divides its attention heads, its KV heads or
    a multiple of them, and its MLP size): a worker refuses to start otherwise, saying which
    sizes work. Prefill and decode must use the same N."""
    gpu_resource: str = Field("nvidia.com/gpu", min_length=1, max_length=253)
    """The device-plugin resource that counts GPUs. Default `nvidia.com/gpu`."""
    resources: ResourceRequirements = sub(ResourceRequirements)
    """CPU and memory requests and limits."""
    parallelism: Parallelism = sub(Parallelism)
    """Parallel layout of one replica."""
    max_num_seqs: int = Field(DEFAULT_MAX_NUM_SEQS, ge=1, le=65536)
    """Most sequences in one engine step. Default 256."""
    max_num_batched_tokens: int = Field(DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=1, le=1_048_576)
    """Most tokens in one engine step (prompts are chunked to fit). Default 8192."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels this role requires, e.g. a GPU product for heterogeneous pools."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Tolerations for tainted nodes."""
    env: list[EnvVar] = Field(default_factory=list, max_length=64)
    """Extra environment variables for the worker container (with engine kind `vllm`, for the
    `engine` container running vLLM)."""
    kv_tiers: KvTiersSpec = sub(KvTiersSpec)
    """KV tiers below the GPU of each replica (pinned host memory, a local disk). Optional."""
    termination_grace_period_seconds: int = Field(60, ge=0, le=3600)
    """Time a worker gets to drain (finish in-flight transfers) before it is killed. Default 60."""

    @property
    def tensor_parallel_size(self) -> int:
        """The replica's tensor-parallel size: `gpus`, or 1 on a CPU pool."""
        return self.parallelism.tensor or max(self.gpus, 1)


class DisaggregationSpec(CrdModel):
    """Whether and when prompts are prefilled on a separate pool."""

    mode: DisaggregationMode = "disaggregated"
    """`disaggregated` (default): separate prefill and decode pools. `colocated`: one pool (the
    decode pool, running both phases); the baseline benchmarks compare against."""
    min_remote_prefill_tokens: int = Field(512, ge=0, le=1_048_576)
    """Uncached prompt tokens from which prefill goes to the prefill pool. Default 512."""
    kv_load_failure_policy: KvLoadFailurePolicy = "recompute"
    """On a failed KV transfer: `recompute` (default) locally, `fail` the request, or `reroute`
    the prefill to another prefill worker within the deadline (kvrail's engine only)."""
    transfer_backend: TransferBackend = "nixl"
    """`nixl` (default; UCX, RDMA across nodes) or `local` (same node only, for tests)."""


class TopologySpec(CrdModel):
    """RDMA-aware placement of the worker pools."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            rule(
                "!has(self.rdmaResource) || self.rdma == 'required'",
                "rdmaResource makes every worker need an RDMA device: set rdma to required",
                ".rdmaResource",
            ),
        )
    )
    rdma: RdmaMode = "preferred"
    """`required`: workers run only on RDMA nodes and UCX may not fall back to TCP. `preferred`
    (default): RDMA nodes first, TCP allowed. `none`: no RDMA."""
    rdma_node_label: str = Field("feature.node.kubernetes.io/rdma.capable", max_length=317)
    """The node label that marks RDMA-capable nodes."""
    rdma_node_label_value: str = Field("true", max_length=63)
    """The value of `rdmaNodeLabel` on RDMA-capable nodes. Default `true`."""
    rdma_resource: str | None = Field(None, max_length=253)
    """An RDMA device-plugin resource each worker requests (e.g. `rdma/hca_shared_devices_a`).
    Only with `rdma: required`. Optional."""
    rdma_resource_count: int = Field(1, ge=1, le=64)
    """How many `rdmaResource` units each worker requests. Default 1."""
    colocation_key: str = Field("topology.kubernetes.io/zone", min_length=1, max_length=317)
    """The node label of the domain prefill and decode prefer to share (a rack or an NVLink
    clique label). Default `topology.kubernetes.io/zone`."""
    spread_key: str = Field("kubernetes.io/hostname", min_length=1, max_length=317)
    """The node label replicas of one role are spread over. Default `kubernetes.io/hostname`."""
    ucx_net_devices: str | None = Field(None, max_length=256)
    """`UCX_NET_DEVICES` for the workers (e.g. `mlx5_0:1`). Optional: UCX picks by default."""


class ScorerSpec(CrdModel):
    """One scorer of the router's `kv-aware` policy and its weight."""

    name: ScorerName
    """`prefix-cache`: prompt blocks the worker does not cache (to prefill), blocks in its host
    and disk KV tiers priced at 0.2 and 0.4 of one (to load). `load`: requests on
    the worker. `kv-utilization`: the worker's KV-cache utilization, 0 to 1 (an invalid report
    counts as full)."""
    weight: int = Field(ge=0, le=1_000_000)
    """What one unit of the scorer costs, in prompt blocks to prefill (the `kv-aware` defaults:
    `prefix-cache` 1, `load` 32, `kv-utilization` 16). 0 leaves the scorer out."""


class RouterSpec(CrdModel):
    """The OpenAI-compatible, KV-aware router in front of the pools."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            rule(
                "!has(self.scorers) || size(self.scorers) == 0 || self.policy == 'kv-aware'",
                "scorers weigh the kv-aware policy: set them only with policy kv-aware",
                ".scorers",
                "FieldValueForbidden",
            ),
            rule(
                "!has(self.scorers) || "
                "self.scorers.all(s, size(self.scorers.filter(t, t.name == s.name)) == 1)",
                "each scorer may be named once",
                ".scorers",
            ),
            rule(
                "!has(self.scorers) || size(self.scorers) == 0 || "
                "self.scorers.exists(s, s.weight > 0)",
                "at least one scorer needs a weight above 0",
                ".scorers",
            ),
        )
    )
    replicas: int = Field(1, ge=0, le=100)
    """Router replicas. Default 1."""
    policy: RouterPolicy = "kv-aware"
    """How a decode worker is picked: `kv-aware` (default: most cached prompt blocks, then load),
    `least-loaded` or `round-robin`."""
    scorers: list[ScorerSpec] = Field(default_factory=list, max_length=8)
    """The `kv-aware` policy's scorers and weights, replacing its defaults (`prefix-cache` 1,
    `load` 32, `kv-utilization` 16); a scorer not listed is not used. Each name at most once, at
    least one weight above 0; only with policy `kv-aware`. Optional: empty keeps the defaults."""
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Type of the router Service. Default ClusterIP."""
    resources: ResourceRequirements = sub(ResourceRequirements)
    """CPU and memory of a router replica."""
    gateway: GatewaySpec | None = None
    """Attach to a Gateway with an HTTPRoute. Optional."""


class AutoscalingSpec(CrdModel):
    """Targets of the planner, which scales each pool on its own signal within min/max.

    Prefill is scaled on the JetStream backlog (jobs and prompt tokens per replica), decode on the
    workers' KV-cache utilization (and, optionally, running plus waiting requests per replica).
    With `enabled: false` the operator applies `replicas` as written, and external scalers (KEDA,
    HPA) may drive it through the pool's scale subresource (decode) or edit `replicas`."""

    enabled: bool = False
    """Let the planner change the worker StatefulSets' replicas. Default false."""
    dry_run: bool = False
    """Decide and record (status, events, metrics) but never change replicas. Default false."""
    interval_seconds: int = Field(5, ge=1, le=300)
    """How often the planner reads the signals and decides. Default 5."""
    prefill_queue_target: int = Field(4, ge=1, le=10000)
    """Queued prefill jobs per prefill replica the planner aims for. Default 4."""
    prefill_queue_tokens_target: int = Field(32768, ge=1, le=100_000_000)
    """Queued prompt tokens per prefill replica the planner aims for. Default 32768."""
    decode_kv_utilization_target: int = Field(80, ge=1, le=100)
    """KV-cache utilization (percent) per decode replica the planner aims for. Default 80."""
    decode_requests_target: int | None = Field(None, ge=1, le=65536)
    """Running plus waiting requests per decode replica the planner aims for. Optional: unset
    scales decode on KV-cache utilization alone."""
    scale_up_stabilization_seconds: int = Field(30, ge=0, le=3600)
    """How long a higher recommendation must hold before scaling up: the planner scales up to the
    lowest recommendation of this window. Default 30."""
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=3600)
    """How long a lower recommendation must hold before scaling down: the planner scales down to
    the highest recommendation of this window. Default 300."""
    cooldown_seconds: int = Field(30, ge=0, le=3600)
    """After a role changed size, no further change of that role for this long (min/max bounds
    excepted). Default 30."""
