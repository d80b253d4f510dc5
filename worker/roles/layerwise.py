"""One prefill job's layer-wise KV write (docs/layerwise.md).

The engine thread calls `LayeredWrite.sink` after each layer of each step of the job's prompt.
After an earlier chunk's last layer the sink queues the blocks that chunk completed (every
layer: a full block is never written again); in the prompt's last step, at a group's last
layer, it queues that group's layers of the blocks left. The NIXL thread writes them in order
(each after the engine's event for its layers, on CUDA) and hashes each group's bytes of every
block when checksums are asked. A prompt restarted by the engine (preempted and recomputed:
its blocks may have been reused meanwhile) gets no more partial writes, and the caller writes
it whole, from its retained blocks, after the prefill. The prefill role then awaits `finish`,
which sends the completion alone once every group landed, or raises as a whole write would.

Whatever ends the job, the role calls `settle` before telling the decode worker anything: it
stops the groups not written yet and returns once no group can be in flight, so a refusal (which
lifts the decode worker's quarantine) never overtakes a group's bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrail.errors import TransferError
from kvrail.messages import PrefillJob
from kvrail.worker.roles.prefill_replies import Refused
from kvrail.worker.transfer.blocks import TransferStats
from kvrail.worker.transfer.connector import Connector
from kvrail.worker.transfer.faults import TransportFaults
from kvrail.worker.transfer.layer_groups import LayerGroups, completed_group, group_layers
from kvrail.worker.transfer.link_speed import WriteTiming

log = logging.getLogger(__name__)

Submit = Callable[[Callable[[], None]], "concurrent.futures.Future[None]"]
"""Runs a call on the NIXL thread, after every one submitted before (`NixlPeers.submit`)."""


@dataclass(frozen=True, slots=True)
class LayeredStats:
    """What a layer-wise write moved (`stats`: every group together), the tail it left after
    the prefill (seconds from the prefill's end to the last group's landing) and the overlap it
    achieved (the fraction of its bytes that landed before the prefill ended)."""

    stats: TransferStats
    num_groups: int
    overlap: float
    writes: tuple[WriteTiming, ...]
    """Each write, in order: the early chunks', then one per group."""

    @property
    def tail_s(self) -> float:
        """Seconds from the prefill's end to the last write's landing (0 if before it)."""
        return max(0.0, self.writes[-1].landed_s) if self.writes else 0.0


class LayeredWrite:
    """The groups of one job: what the engine handed over, what landed, and why it stopped."""

    def __init__(
        self,
        job: PrefillJob,
        groups: LayerGroups,
        connector: Connector,
        faults: TransportFaults,
        submit: Submit,
        deadline_monotonic: float,
        block_size: int,
    ) -> None:
        self.job = job
        self.groups = groups
        self._block_size = block_size
        self._early: tuple[int, ...] = ()  # source blocks sent whole after an earlier chunk
        self._tokens_done = 0  # prompt tokens with KV after the last step seen
        self._restarted = False  # the engine recomputed the prompt: no more partial writes
        self._groups_done = 0
        self._connector = connector
        self._faults = faults
        self._submit = submit
        self._deadline = deadline_monotonic
        self._src: tuple[int, ...] | None = None  # the source blocks of the groups handed over
        self._checksums: list[tuple[str, ...]] = [() for _ in groups]
        self._written: list[tuple[TransferStats, int, float]] = []  # blocks, landed (monotonic)
        self._error: TransferError | None = None  # the first group that failed (NIXL thread)
        self._stopped = ""  # why the groups left stopped (a cancel, a settled job, the deadline)

    def sink(
        self, num_layers_done: int, block_ids: Sequence[int], ready: Any, tokens: tuple[int, int]
    ) -> None:
        """`LayerSinks`' callback, on the engine thread: queue what the layers that ran complete."""
        skip, (start, end) = self.job.first_block_index, tokens
        # A step starting before the last one ended: the engine recomputes the prompt (it was
        # preempted), and blocks sent early may have been reused and rewritten meanwhile.
        self._restarted |= start < self._tokens_done
        if end < len(self.job.token_ids):  # an earlier chunk of the prompt
            if num_layers_done == self.groups[-1]:
                self._chunk_done(block_ids, ready, end)
            return
        group = completed_group(self.groups, num_layers_done)
        if group is None:
            return
        src = tuple(block_ids[skip:])
        if self._src is None:
            self._src = src
            self._restarted |= src[: len(self._early)] != self._early  # (a bug if so)
        self._submit(lambda: self._write_group(group, src, ready))

    def _chunk_done(self, block_ids: Sequence[int], ready: Any, num_tokens_done: int) -> None:
        """Queue the blocks an earlier chunk filled (engine thread)."""
        self._tokens_done = num_tokens_done
        first = self.job.first_block_index + len(self._early)
        blocks = tuple(block_ids[first : num_tokens_done // self._block_size])
        if self._restarted or not blocks:
            return
        index = len(self._early)
        self._early += blocks
        everything = (0, self.groups[-1])

        def write() -> None:  # every layer of the blocks: none is written again
            self._write(index, blocks, everything, ready, "chunk")

        self._submit(write)

    def stop(self, reason: str) -> None:
        """Write no more groups (a cancel, or the job settled); the job ends as `reason`."""
        self._stopped = self._stopped or reason

    def _write_group(self, group: int, src: tuple[int, ...], ready: Any) -> None:  # NIXL thread
        job = self.job
        if len(src) != len(job.dest_block_ids) or src != self._src:
            self._error = self._error or TransferError(f"{len(src)} blocks, not the job's")
            return
        layers, done = group_layers(self.groups, group), len(self._early)
        if not self._write(done, src[done:], layers, ready, str(group)):
            return
        if job.with_checksums:  # of every block, those sent early too (never written again)
            try:
                self._checksums[group] = self._connector.layer_checksums(src, layers)
            except TransferError as err:
                self._error = err
                return
        self._groups_done += 1

    def _write(
        self, index: int, src: tuple[int, ...], layers: tuple[int, int], ready: Any, what: str
    ) -> bool:  # NIXL thread
        """Write `layers` of `src` into the job's destination blocks from `index` on; False when
        it did not (stopped, restarted, or failed: `_error`)."""
        job = self.job
        if self._error is not None or self._stopped or self._restarted:
            return False
        if time.time() >= job.deadline_unix_s:
            self._stopped = "deadline"
            return False
        if not src:
            return True
        dst = job.dest_block_ids[index : index + len(src)]
        try:
            stats = self._faults.write_layers(
                self._connector, job.request_id, job.dest_agent_name, src, dst, layers,
                self._deadline, ready,
            )  # fmt: skip
        except TransferError as err:
            self._error = err
            return False
        self._written.append((stats, len(src), time.monotonic()))
        log.debug("layer group written request_id=%s group=%s layers=%d-%d blocks=%d bytes=%d",
                  job.request_id, what, layers[0], layers[1] - 1, len(src),
                  stats.num_bytes)  # fmt: skip
        return True

    async def settle(self) -> None:
        """Stop the groups not written yet and wait until none is in flight (idempotent)."""
        self.stop("abandoned")
        barrier = self._submit(lambda: None)  # the NIXL thread runs calls in order
        await asyncio.wrap_future(barrier)

    async def finish(
        self, src: Sequence[int], notification: Callable[[tuple[str, ...]], bytes]
    ) -> LayeredStats | None:
        """After the prefill: wait for every group, then send `notification(checksums)` (the
        completion, with every group's checksums, group-major). Returns what was sent, or None
        when the engine handed over not every group for these blocks, or restarted the prompt
        (the caller writes the whole prompt). Raises TransferError when a write failed, Refused
        when the writes stopped."""
        computed = time.monotonic()
        await asyncio.wrap_future(self._submit(lambda: None))  # every group queued has run
        if self._error is not None:
            raise self._error
        if self._stopped:
            raise Refused(self._stopped)
        if (
            self._restarted
            or self._src != tuple(src)
            or self._groups_done != len(self.groups)
            or not self._written
        ):
            return None
        sums = tuple(s for group in self._checksums for s in group)
        note = notification(sums)
        job, connector, faults = self.job, self._connector, self._faults
        peer = job.dest_agent_name
        sent = self._submit(lambda: faults.notify(connector, job.request_id, peer, note))
        await asyncio.wrap_future(sent)
        writes = tuple(
            WriteTiming(stats.num_bytes, blocks, stats.seconds, landed - computed)
            for stats, blocks, landed in self._written
        )
        num_bytes = sum(w.num_bytes for w in writes)
        early = sum(w.num_bytes for w in writes if w.landed_s <= 0)
        total = TransferStats(
            num_bytes, sum(w.seconds for w in writes), self._written[-1][0].transport
        )
        return LayeredStats(
            total, len(self.groups), early / num_bytes if num_bytes else 0.0, writes
        )
