"""Build a worker's engine on one device or, with tensor parallelism, on several (rank 0 here).

With `tensor_parallel_size` N > 1 the model must split over N ranks (checked before anything
starts: `kvrail.worker.parallel.layout`, a clear ConfigError naming the sizes that would work),
and a CUDA worker needs N GPUs. Rank 0 starts ranks 1..N-1 (`launch.RankSet`), joins their group
(NCCL on GPUs, gloo on CPU), builds its own shard while they build theirs, waits until every
rank is ready and returns the engine with the ranks, which the caller must `close()`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvrail.errors import ConfigError
from kvrail.model_files import resolve
from kvrail.worker.engine.config import EngineConfig, dtype_name
from kvrail.worker.engine.engine import LLMEngine
from kvrail.worker.models.llama_shape import LlamaShape
from kvrail.worker.models.loader import load, prepare
from kvrail.worker.models.quant import Quantization, check_device, resolve_quantization
from kvrail.worker.parallel.group import COLLECTIVE_TIMEOUT_S, TpGroup
from kvrail.worker.parallel.layout import check_tensor_parallel_size
from kvrail.worker.ranks.launch import RankSet
from kvrail.worker.ranks.spec import RankSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BuiltEngine:
    engine: LLMEngine
    ranks: RankSet | None
    """Ranks 1..N-1 (None on one device)."""


def check_split(
    source: str, tp_size: int, device_type: str, dtype: torch.dtype, quantization: str = "auto"
) -> Quantization:
    """Raise ConfigError unless `source`'s model splits over `tp_size` ranks of this machine
    and runs in `dtype` and `quantization` there; returns the quantization resolved."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(prepare(resolve(source)))
    resolved = resolve_quantization(quantization, config)
    check_device(resolved, device_type, dtype)
    shape = LlamaShape.from_config(config)
    check_tensor_parallel_size(
        tp_size, shape.num_heads, shape.num_kv_heads, shape.intermediate_size
    )
    if device_type == "cuda" and torch.cuda.device_count() < tp_size:
        raise ConfigError(
            f"tensor_parallel_size={tp_size} needs {tp_size} GPUs, this pod has "
            f"{torch.cuda.device_count()}"
        )
    return resolved


def build_engine(
    source: str,
    config: EngineConfig,
    *,
    dtype: torch.dtype,
    device_type: str,
    tensor_parallel_size: int = 1,
    agent_name: str | None = None,
    torch_num_threads: int | None = None,
    log_level: str = "INFO",
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    quantization: str = "auto",
) -> BuiltEngine:
    """The engine (rank 0's shard) and its other ranks. `agent_name`: rank 0's NIXL agent; the
    ranks register theirs as `launch.rank_agent_name(agent_name, rank)` (None: no agents).
    `quantization`: see `kvrail.worker.models.quant`."""
    if tensor_parallel_size == 1:
        engine = LLMEngine.from_source(
            source, config, dtype=dtype, device=device_type, quantization=quantization
        )
        return BuiltEngine(engine, None)
    quantization = check_split(source, tensor_parallel_size, device_type, dtype, quantization)
    template = RankSpec(
        rank=1, size=tensor_parallel_size, source=source, dtype=dtype_name(dtype),
        kv_dtype=config.kv_dtype, quantization=quantization,
        device_type=device_type, num_blocks=config.num_blocks, block_size=config.block_size,
        store_port=0, agent_name=agent_name, torch_num_threads=torch_num_threads,
        collective_timeout_s=collective_timeout_s, log_level=log_level,
    )  # fmt: skip
    ranks = RankSet.start(template, tensor_parallel_size)
    group: TpGroup | None = None
    try:
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        group = TpGroup.join(0, tensor_parallel_size, ranks.store, device, collective_timeout_s)
        ranks.attach(group)
        loaded = load(source, lazy=True)
        engine = LLMEngine.from_loaded(
            loaded, config, dtype=dtype, device=str(device), group=group, peers=ranks,
            quantization=quantization,
        )  # fmt: skip
        ranks.wait_ready()
    except BaseException:
        ranks.close()
        if group is not None:
            group.close()
        raise
    log.info(
        "tensor parallel engine ready size=%d kv_bytes_per_rank=%s",
        tensor_parallel_size, ",".join(str(r.kv_bytes) for r in ranks.readies),
    )  # fmt: skip
    return BuiltEngine(engine, ranks)
