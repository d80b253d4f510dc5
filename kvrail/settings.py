"""Settings: the only module that reads the environment.

Every component builds one `Settings` at start: defaults, overridden by a YAML file (path in
`KVRAIL_CONFIG` or passed explicitly), overridden by `KVRAIL_<FIELD>` environment variables. Lists
are comma-separated in the environment. Unknown keys and invalid values raise `ConfigError` naming
the field. Secrets are never values here: only paths to files that hold them (mounted Secrets in a
cluster, files locally), read by `read_secret`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from kvrail.crd.spec import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    BlockSize,
    DisaggregationMode,
    DType,
    KvDType,
    KvLoadFailurePolicy,
    RdmaMode,
    RouterPolicy,
    ScorerSpec,
    TransferBackend,
    WeightQuantization,
)
from kvrail.errors import ConfigError
from kvrail.messages import WorkerRole
from kvrail.tls import check_etcd_endpoints
from kvrail.transfer_settings import TransferSettings

ENV_PREFIX = "KVRAIL_"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def default_cache_dir() -> Path:
    """`$KVRAIL_CACHE_DIR`, else `$XDG_CACHE_HOME/kvrail`, else `~/.cache/kvrail`."""
    explicit = os.environ.get(ENV_PREFIX + "CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvrail"


class Settings(TransferSettings):
    """Configuration shared by every kvrail process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = Field("default", description="Kubernetes namespace of the pool (key scope)")
    pool: str = Field("local", description="InferencePool name (key scope)")
    etcd_endpoints: tuple[str, ...] = Field(("http://127.0.0.1:2379",), min_length=1)
    etcd_username: str | None = None
    etcd_password_file: Path | None = None
    etcd_ca_file: Path | None = None
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str | None = None
    nats_password_file: Path | None = None
    nats_ca_file: Path | None = None
    cache_dir: Path = Field(default_factory=default_cache_dir)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    http_port: int | None = Field(None, ge=1, le=65535, description="else the component's own")

    # Pod identity (the downward API in a cluster; generated locally).
    pod_name: str | None = None
    pod_ip: str | None = None
    pod_uid: str | None = None
    node_name: str | None = None

    # The model, and what every worker of the pool must share (the fingerprint's inputs).
    model: str = Field("smollm2", description="packaged model name, .gguf file or model directory")
    model_revision: str | None = None
    model_hash: str | None = Field(None, description="the operator's hash of spec.model")
    served_model_name: str | None = None
    dtype: DType | Literal["auto"] = "auto"
    kv_dtype: KvDType = Field(
        "auto",
        description="KV cache dtype (auto: dtype's); FP8 also on GPUs of compute capability "
        "8.9+, another float on CPU only",
    )
    quantization: WeightQuantization = Field(
        "auto",
        description="weights: auto (the checkpoint's), none or fp8 (on CPU, and with bfloat16 "
        "on GPUs of compute capability 8.9+)",
    )
    block_size: BlockSize = Field(
        DEFAULT_BLOCK_SIZE, description="tokens per KV block (InferencePool spec.model.blockSize)"
    )
    max_model_len: int | None = Field(None, ge=16)
    tensor_parallel_size: int = Field(1, ge=1, le=64)

    # Engine limits and disaggregation (mirrors the InferencePool fields of the same names).
    max_num_seqs: int = Field(DEFAULT_MAX_NUM_SEQS, ge=1)
    max_num_batched_tokens: int = Field(DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=1)
    disaggregation_mode: DisaggregationMode = "disaggregated"
    min_remote_prefill_tokens: int = Field(512, ge=0)
    kv_load_failure_policy: KvLoadFailurePolicy = "recompute"
    transfer_backend: TransferBackend = "nixl"
    transfer_checksums: bool = Field(
        False, description="checksum every transferred KV block (always on in tests)"
    )
    num_kv_blocks: int = Field(512, ge=2, description="KV cache blocks per worker (incl. null)")
    kv_host_tier_bytes: int = Field(
        0, ge=0,
        description="pinned host memory of the worker's host KV tier (0: none): full GPU blocks "
        "are written behind to it and loaded back on a prefix hit",
    )  # fmt: skip
    kv_disk_tier_path: str = Field(
        "", description="directory of the worker's disk KV tier, fed by the host tier (empty: none)"
    )
    kv_disk_tier_bytes: int = Field(0, ge=0, description="bytes the disk KV tier may hold")
    max_num_mixed_prefill_tokens: int = Field(
        0, ge=0,
        description="prefill tokens at most in a step that also decodes (0: the step budget "
        "alone): long prompts take more steps instead of stalling every decode",
    )  # fmt: skip
    max_mixed_graph_tokens: int = Field(
        1024, ge=0,
        description="on CUDA, the largest step with prefill tokens that replays a captured graph "
        "(0: such steps run eagerly); larger steps run eagerly",
    )  # fmt: skip
    torch_num_threads: int | None = Field(
        None, ge=1, le=1024, description="torch intra-op threads of a worker; unset: torch's"
    )
    pdl: bool = Field(
        True,
        description="programmatic dependent launch of a worker's decode kernels on Hopper and "
        "later GPUs; KVRAIL_PDL=0 is the A/B switch and the way out (read by kvrail.kernels)",
    )
    rdma: RdmaMode = "preferred"
    zero_kv_on_release: bool = Field(
        False, description="zero KV blocks when released (InferencePool security.zeroKVOnRelease)"
    )
    remote_prefill_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="how long a decode worker waits for a remote prefill's KV before following "
        "kv_load_failure_policy (never past the request's deadline)",
    )  # fmt: skip
    drain_timeout_s: float = Field(
        30.0, ge=0, le=3600,
        description="on SIGTERM, how long a worker lets in-flight work finish before failing it",
    )  # fmt: skip

    # The vLLM agent (`python -P -m kvrail.agent`, beside a `vllm serve` of a vLLM pool).
    role: WorkerRole | None = Field(
        None,
        description="what the agent's vLLM server does (kvrail workers take --role); the old "
        "spelling `both` still means colocated",
    )
    vllm_url: str | None = Field(
        None, description="the agent's own vLLM server, e.g. http://127.0.0.1:8000"
    )

    # Router.
    router_policy: RouterPolicy = "kv-aware"
    router_scorers: tuple[ScorerSpec, ...] = Field(
        (),
        description="the kv-aware policy's scorers and weights, replacing its defaults "
        "(InferencePool spec.router.scorers); in the environment name=weight pairs, "
        "comma-separated, e.g. prefix-cache=1,load=32; empty: the policy's own",
    )
    router_host: str = Field("127.0.0.1", description="address the router listens on")
    request_timeout_s: float = Field(
        600.0, gt=0, le=86_400, description="deadline of every request, from its arrival"
    )
    router_max_attempts: int = Field(
        3, ge=1, le=10, description="decode workers tried for a request nobody took yet"
    )
    max_choices: int = Field(
        16, ge=1, le=128,
        description="the most choices one request may ask for (n, and best_of for completions); "
        "more is a 400",
    )  # fmt: skip
    api_keys_file: Path | None = None
    generation_config: Literal["model", "openai"] = Field(
        "model",
        description="what an omitted sampling field means: the model's generation config where "
        "it has one (model), or always OpenAI's defaults (openai)",
    )
    allow_special_tokens_in_prompts: bool = Field(
        False,
        description="encode special-token text that clients write (e.g. <|im_end|>) as control "
        "tokens; off: only the chat template emits them (for trusted clients only)",
    )
    chat_template: Path | None = Field(
        None, description="a Jinja chat template file used instead of the model's (router)"
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="the format of the model's tool calls; auto: read from the chat template "
        "([TOOL_CALLS]: mistral, <tool_call>: hermes, <|python_tag|>: llama3_json, else hermes)",
    )
    reasoning_parser: Literal["auto", "think", "none"] = Field(
        "auto",
        description="split a model's <think>...</think> reasoning from its answer; auto: when "
        "the chat template writes both tags",
    )

    # Operator.
    operator_image: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        description="image of the pools without spec.image (the chart sets the operator's own); "
        "unset: ghcr.io/kvrail/kvrail:<version>",
    )
    operator_share_access: bool = Field(
        True,
        description="give pools that name no etcd or NATS of their own the operator's "
        "credentials and CAs, in a Secret <pool>-infrastructure of their namespace",
    )
    operator_metrics_port: int | None = Field(
        None, ge=1, le=65535, description="serve the operator's Prometheus metrics; unset: off"
    )
    operator_cleanup_retries: int = Field(
        6, ge=0, le=1000, description="retries of a pool's etcd/NATS cleanup before giving up"
    )
    operator_cleanup_retry_delay_s: float = Field(10.0, gt=0, le=3600)
    operator_network_policies: bool = Field(
        True, description="a NetworkPolicy per pool: its workers reachable only by its workers"
    )

    @field_validator("namespace", "pool")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not _DNS_LABEL.match(value):
            raise ValueError("must be a DNS-1123 label (lowercase letters, digits, '-'; <= 63)")
        return value

    @field_validator("etcd_endpoints")
    @classmethod
    def _endpoints(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for endpoint in value:
            if not re.match(r"^https?://[^/:]+:\d+$", endpoint):
                raise ValueError(f"etcd endpoint {endpoint!r} is not http(s)://host:port")
        return value

    @field_validator("block_size", mode="before")
    @classmethod
    def _block_size_text(cls, value: object) -> object:
        """The environment gives text; the enum is of ints."""
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value

    @field_validator("router_scorers", mode="before")
    @classmethod
    def _scorers_text(cls, value: object) -> object:
        return parse_scorers(value) if isinstance(value, str) else value

    @field_validator("role", mode="before")
    @classmethod
    def _old_role_spelling(cls, value: object) -> object:
        return "colocated" if value == "both" else value

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, value: str) -> str:
        if not re.match(r"^(nats|tls)://[^/]+:\d+$", value):
            raise ValueError(f"{value!r} is not nats://host:port or tls://host:port")
        return value

    @model_validator(mode="after")
    def _kv_tiers(self) -> Settings:
        """A disk tier is fed by the host tier and needs a size; a size without a path is a
        tier that silently does not exist."""
        if self.kv_disk_tier_path and not (self.kv_host_tier_bytes and self.kv_disk_tier_bytes):
            raise ValueError("kv_disk_tier_path needs kv_host_tier_bytes and kv_disk_tier_bytes")
        if self.kv_disk_tier_bytes and not self.kv_disk_tier_path:
            raise ValueError("kv_disk_tier_bytes needs kv_disk_tier_path")
        return self

    @model_validator(mode="after")
    def _etcd_tls(self) -> Settings:
        """A CA file with plaintext endpoints, or mixed schemes, would be a silent fallback (the
        clients check again, for settings copied without validation; see `kvrail.tls`)."""
        try:
            check_etcd_endpoints(self.etcd_endpoints, self.etcd_ca_file)
        except ConfigError as err:
            raise ValueError(str(err)) from err
        return self


def format_scorers(scorers: tuple[ScorerSpec, ...] | list[ScorerSpec]) -> str:
    """`router_scorers` as the environment spells it: `name=weight` pairs, comma-separated."""
    return ",".join(f"{s.name}={s.weight}" for s in scorers)


def parse_scorers(text: str) -> list[dict[str, str]]:
    """The inverse of `format_scorers`, before validation; raises ValueError for a pair without
    `=`."""
    out = []
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, sep, weight = pair.partition("=")
        if not sep:
            raise ValueError(f"{pair!r} is not name=weight")
        out.append({"name": name.strip(), "weight": weight.strip()})
    return out


def load_settings(
    config_file: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Defaults < YAML file < environment. Raises ConfigError with the offending field."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        values.update(_read_file(Path(path)))
    fields = Settings.model_fields
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_PREFIX + "CONFIG":
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in fields:
            raise ConfigError(f"unknown setting {key} (known: {_known_env()})")
        values[name] = tuple(raw.split(",")) if name == "etcd_endpoints" else raw
    try:
        return Settings(**values)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in err.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from err


def read_secret(path: Path | None) -> str | None:
    """Read a credential from a file (a mounted Secret), stripping one trailing newline."""
    if path is None:
        return None
    try:
        return path.read_text().removesuffix("\n")
    except OSError as err:
        raise ConfigError(f"cannot read credential file {path}: {err.strerror}") from err


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", str(key)).lower()  # camelCase accepted too
        if name not in Settings.model_fields:
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        out[name] = value
    return out


def _known_env() -> str:
    return ", ".join(ENV_PREFIX + name.upper() for name in Settings.model_fields)


def describe_settings() -> str:
    """Every setting, one a line: its variable, default, the values it takes where they are a
    fixed set, and what it means (`kvrail config --options`)."""
    lines = []
    for name, field in Settings.model_fields.items():
        default = "(computed)" if field.default_factory is not None else repr(field.default)
        choices = [
            str(value)
            for arg in (field.annotation, *get_args(field.annotation))
            if get_origin(arg) is Literal
            for value in get_args(arg)
        ]
        values = f" [{' | '.join(choices)}]" if choices else ""
        meaning = f"  {field.description}" if field.description else ""
        lines.append(f"{ENV_PREFIX}{name.upper()}={default}{values}{meaning}")
    return "\n".join(lines) + "\n"
