"""Engine configuration, checked when built, and the dtypes an engine computes and caches in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

from kvrail.errors import ConfigError
from kvrail.kernels.reference import FP8_DTYPES
from kvrail.settings import Settings
from kvrail.worker.models.quant import check_fp8_device

DTYPES: Final = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}  # fmt: skip
"""Every dtype by the name settings, the CRD and the fingerprint give it."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ConfigError(f"kvrail has no name for dtype {dtype}")


def kv_cache_dtype(kv_dtype: str, model_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The KV cache's dtype for setting `kv_dtype` ("auto": the model's). On a CPU any of
    `DTYPES`: the torch reference kernels write K and V rounded to it (FP8 saturating at its
    largest finite value, with a scale of 1) and compute attention in float32. On CUDA the
    model's own dtype or FP8 (e4m3 or e5m2, on GPUs of compute capability 8.9 or later): the
    Triton kernels write K and V saturated as the reference does, read them in FP8 and compute
    in the model's dtype. Any other dtype is refused rather than run as another."""
    if kv_dtype == "auto":
        return model_dtype
    if kv_dtype not in DTYPES:
        raise ConfigError(f"kv_dtype {kv_dtype!r} is not auto or one of {sorted(DTYPES)}")
    dtype = DTYPES[kv_dtype]
    if device_type == "cuda" and dtype != model_dtype:
        if dtype not in FP8_DTYPES:
            raise ConfigError(
                f"kv_dtype {kv_dtype} with {dtype_name(model_dtype)} weights on CUDA: kvrail's "
                "CUDA kernels read a KV cache in the weights' dtype or in FP8 (float8_e4m3fn, "
                "float8_e5m2); another float dtype runs on CPU only, in the reference path"
            )
        check_fp8_device(f"kv_dtype {kv_dtype}", device_type)
    return dtype


def _setting(name: str) -> Any:
    """The default of `Settings.<name>`: a field the worker fills from settings has its default
    there alone, so an engine built without it runs as a deployed worker would."""
    return Settings.model_fields[name].default


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes of the KV pool and of one scheduling step.

    `num_blocks` counts the null block 0, so `num_blocks - 1` blocks hold tokens.
    `max_num_batched_tokens` is the per-step token budget; with chunked prefill a prompt longer
    than it is computed over several steps. `max_model_len` bounds prompt + output tokens (0:
    the model's own limit, which the engine fills in; a request must also fit the KV pool, see
    `LLMEngine.max_request_tokens`).
    `enable_cuda_graphs` replays captured graphs (CUDA devices only): for decode-only steps, and
    for steps with prefill chunks of up to `max_mixed_graph_tokens` tokens in all (0: none; the
    step budget bounds it too), see `kvrail.worker.engine.cuda_graph`.
    `zero_kv_on_release` zeroes every block whose last reference is dropped, at once (and keeps
    no finished request's blocks in the prefix cache).
    `max_num_mixed_prefill_tokens` (0: no limit of its own) bounds the prefill tokens of a step
    that also decodes: a long prompt then takes more steps, and the requests decoding beside it
    never wait on one long step (Sarathi-Serve's stall-free batching).
    `async_scheduling` queues each step on the device before the previous one has finished
    (see `LLMEngine`); None means on for CUDA devices, off elsewhere (on a CPU nothing overlaps,
    and it would only delay each token by a step).
    `kv_dtype` is the KV cache's dtype by name, "auto" for the model's (see `kv_cache_dtype`).
    `kv_host_tier_bytes`, `kv_disk_tier_path`, `kv_disk_tier_bytes`: the lower KV tiers (pinned
    host memory; a directory fed by it), see `kvrail.worker.engine.kv_tiers`; 0 and "": none.
    `grammar_threads`: the threads that fill grammar masks (`grammar_masks.MaskFiller`; 0:
    llguidance's default, 80% of the CPUs, at most 32).
    `shared_prefix_decode`: decode rows that share their first blocks (a request's `n` choices,
    a cached system prompt) read those blocks once per group of rows, not once per row
    (`kvrail.worker.engine.shared_prefix`); off (the default until it has run on a GPU), every
    row reads its whole context.

    The fields the worker fills from `kvrail.settings.Settings` default to Settings' defaults
    (one default each). `block_size` is any positive size here (tests use 4); what a pool may
    deploy is `kvrail.crd.spec.BlockSize`, checked where the value enters (the API, Settings).
    """

    num_blocks: int
    max_model_len: int = 0
    block_size: int = _setting("block_size")
    max_num_batched_tokens: int = _setting("max_num_batched_tokens")
    max_num_seqs: int = _setting("max_num_seqs")
    max_num_mixed_prefill_tokens: int = _setting("max_num_mixed_prefill_tokens")
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enable_cuda_graphs: bool = True
    max_mixed_graph_tokens: int = _setting("max_mixed_graph_tokens")
    zero_kv_on_release: bool = _setting("zero_kv_on_release")
    async_scheduling: bool | None = None
    kv_dtype: str = _setting("kv_dtype")
    grammar_threads: int = 0
    shared_prefix_decode: bool = False
    kv_host_tier_bytes: int = _setting("kv_host_tier_bytes")
    kv_disk_tier_path: str = _setting("kv_disk_tier_path")
    kv_disk_tier_bytes: int = _setting("kv_disk_tier_bytes")

    def __post_init__(self) -> None:
        if self.kv_dtype != "auto" and self.kv_dtype not in DTYPES:
            raise ConfigError(f"engine kv_dtype {self.kv_dtype!r} is not auto or one of "
                              f"{sorted(DTYPES)}")  # fmt: skip
        for name in ("num_blocks", "block_size", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine {name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len < 0:
            raise ConfigError(f"engine max_model_len must be >= 0, got {self.max_model_len}")
        if self.num_blocks < 2:
            raise ConfigError(
                f"engine num_blocks must be at least 2 (1 null), got {self.num_blocks}"
            )
        if self.max_mixed_graph_tokens < 0:
            raise ConfigError(
                f"engine max_mixed_graph_tokens must be >= 0, got {self.max_mixed_graph_tokens}"
            )
        if self.max_num_mixed_prefill_tokens < 0:
            raise ConfigError(
                f"engine max_num_mixed_prefill_tokens must be >= 0, got "
                f"{self.max_num_mixed_prefill_tokens}"
            )
        if self.grammar_threads < 0:
            raise ConfigError(f"engine grammar_threads must be >= 0, got {self.grammar_threads}")
        if self.kv_host_tier_bytes < 0 or self.kv_disk_tier_bytes < 0:
            raise ConfigError("engine KV tier sizes must be >= 0")
        if bool(self.kv_disk_tier_path) != bool(self.kv_disk_tier_bytes):
            raise ConfigError("engine kv_disk_tier_path and kv_disk_tier_bytes go together")
        if self.kv_disk_tier_path and not self.kv_host_tier_bytes:
            raise ConfigError("engine disk KV tier is fed by the host tier: set kv_host_tier_bytes")
        if self.max_num_seqs < 1:
            raise ConfigError(f"engine max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
