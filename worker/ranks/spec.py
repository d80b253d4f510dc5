"""What a rank process builds and how it finds its group: sent by rank 0 as its first message."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from kvrail.crd.spec import KvDType
from kvrail.worker.models.quant import Quantization

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Rank `rank` of `size`: load `source` (a packaged model name, a .gguf file or a model
    directory, as `kvrail.model_files.resolve` takes it) in `dtype` on a `device_type` device
    (CUDA: device `rank` of the pod's GPUs), allocate `num_blocks` KV blocks of `block_size`
    tokens in `kv_dtype` (`EngineConfig.kv_dtype`) for its KV heads, join the group through rank
    0's store on `store_port` (loopback), and register its KV shard as NIXL agent `agent_name`
    (None: no KV transfer, engine tests)."""

    rank: int
    size: int
    source: str
    dtype: str
    device_type: str
    num_blocks: int
    block_size: int
    store_port: int
    agent_name: str | None = None
    torch_num_threads: int | None = None
    collective_timeout_s: float = 120.0
    log_level: str = "INFO"
    kv_dtype: str = "auto"
    quantization: Quantization = "none"
    """What rank 0 resolved (`none` or `fp8`), never `auto`: every rank runs the same."""

    def __post_init__(self) -> None:
        if not 1 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not one of 1..{self.size - 1}")
        if self.dtype not in DTYPES or self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"no rank runs {self.dtype} on {self.device_type}")
        if self.kv_dtype not in typing.get_args(KvDType):
            raise ValueError(f"no rank caches KV in {self.kv_dtype}")
        if self.quantization not in typing.get_args(Quantization):
            raise ValueError(f"no rank runs weights in {self.quantization}")


@dataclass(frozen=True, slots=True)
class Started:
    """Rank -> rank 0: the spec was read; the rank joins the group now."""

    rank: int
    pid: int


@dataclass(frozen=True, slots=True)
class Ready:
    """Rank -> rank 0: model and KV shard built; `metadata` is its KV connector's (b"" when
    it has none). From now on it runs rank 0's commands."""

    rank: int
    metadata: bytes
    kv_bytes: int


@dataclass(frozen=True, slots=True)
class Failed:
    """Rank -> rank 0: it could not start; `reason` says why (no prompt or KV data in it)."""

    rank: int
    reason: str
