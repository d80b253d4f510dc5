"""The collectives of one worker's tensor-parallel group: gloo on CPU, NCCL on GPUs.

A `TpGroup` is this process's rank in its worker's group and the three collectives the split
model runs: `all_reduce` (after each row-parallel projection and the embedding), `gather_to_first`
(the LM head's vocabulary shards, to rank 0, which samples) and `broadcast_from_first` (the
sampled tokens, so every rank can feed them to the next step without the host). Every rank calls
them in the same order; rank 0's engine decides that order (`kvrail.worker.engine.rank_loop`).
A group of size 1 runs no collective at all and initialises nothing.

Guarantees: a collective whose peer died raises (gloo at once: the peer's socket closes; NCCL
within `timeout_s`, or sooner when `abort()` is called from another thread), it never returns a
partial result. `seconds` adds up the wall time spent in collectives when `timed`, per collective
in `seconds_by_op` (benchmarks: on CPU the collectives are synchronous, so this is their share of
a step, waits for the slower rank included; on a GPU it measures only the host's enqueueing).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0
"""How long a collective may wait for a peer: a rank that stops answering fails the step."""


class TpGroup:
    def __init__(self, rank: int = 0, size: int = 1, process_group: object | None = None) -> None:
        """Rank `rank` of `size`; without a process group (tests of the shard arithmetic) every
        collective raises."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside 0..{size - 1}")
        self.rank = rank
        self.size = size
        self._pg = process_group
        self.timed = False
        self.seconds = 0.0
        self.seconds_by_op: dict[str, float] = {}
        self.num_collectives = 0

    @classmethod
    def single(cls) -> TpGroup:
        return cls()

    @classmethod
    def join(
        cls,
        rank: int,
        size: int,
        store: Any,
        device: torch.device,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> TpGroup:
        """Join the default process group of `size` ranks through `store` (rank 0 hosts it):
        NCCL on a CUDA device (bound to it), gloo otherwise."""
        if size == 1:
            return cls.single()
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, object] = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            kwargs["device_id"] = device  # eager NCCL init: a missing GPU fails here, not mid-step
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s), **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
        log.info("tensor parallel group joined rank=%d size=%d backend=%s", rank, size, backend)
        return cls(rank, size, dist.group.WORLD)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @contextlib.contextmanager
    def _timing(self, op: str) -> Iterator[None]:
        self.num_collectives += 1
        if not self.timed:
            yield
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.seconds += elapsed
            self.seconds_by_op[op] = self.seconds_by_op.get(op, 0.0) + elapsed

    def _group(self) -> object:
        if self._pg is None:
            raise RuntimeError("this tensor-parallel group is not joined (or was closed)")
        return self._pg

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.size == 1:
            return x
        self._group()
        with self._timing("all_reduce"):
            dist.all_reduce(x, group=self._pg)  # type: ignore[arg-type, unused-ignore]
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `x` [n, w] side by side, [n, size * w], in rank order. Other
        ranks: None (they sent theirs)."""
        if self.size == 1:
            return x
        self._group()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        with self._timing("gather"):
            dist.gather(x, parts, dst=0, group=self._pg)  # type: ignore[arg-type]
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place on the others; same shape and dtype)."""
        if self.size == 1:
            return x
        self._group()
        with self._timing("broadcast"):
            dist.broadcast(x, src=0, group=self._pg)  # type: ignore[arg-type]
        return x

    def abort(self) -> None:
        """Make collectives blocked on a dead peer raise (NCCL; gloo raises on its own).
        Safe to call from another thread; the group is unusable afterwards."""
        if self.size == 1 or self._pg is None:
            return
        backend = dist.get_backend(self._pg)  # type: ignore[arg-type]
        if backend != "nccl":
            return
        with contextlib.suppress(Exception):  # best effort: the process exits next
            self._pg._get_backend(torch.device("cuda")).abort()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Leave the group (idempotent); collectives raise afterwards."""
        if self._pg is not None and dist.is_initialized():
            with contextlib.suppress(Exception):  # a peer may be gone already
                dist.destroy_process_group()
        self._pg = None
