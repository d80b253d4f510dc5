"""One prefill job's layer-wise KV write (docs/layerwise.md).

The engine thread calls `LayeredWrite.sink` after each layer of the job's last prefill step; at a
group's last layer the sink queues that group's write on the NIXL thread and returns. The NIXL
thread writes the groups in order (each after the engine's event for its layers, on CUDA), and
hashes each group's bytes when checksums are asked. The prefill role then awaits `finish`,
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
    tail_s: float
    overlap: float


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
    ) -> None:
        self.job = job
        self.groups = groups
        self._connector = connector
        self._faults = faults
        self._submit = submit
        self._deadline = deadline_monotonic
        self._src: tuple[int, ...] | None = None  # the source blocks of the groups handed over
        self._checksums: list[tuple[str, ...]] = [() for _ in groups]
        self._written: list[tuple[TransferStats, float]] = []  # and when it landed (monotonic)
        self._error: TransferError | None = None  # the first group that failed (NIXL thread)
        self._stopped = ""  # why the groups left stopped (a cancel, a settled job, the deadline)

    def sink(self, num_layers_done: int, block_ids: Sequence[int], ready: Any) -> None:
        """`LayerSinks`' callback, on the engine thread: queue a group whose layers ran."""
        group = completed_group(self.groups, num_layers_done)
        if group is None:
            return
        src = tuple(block_ids[self.job.first_block_index :])
        self._src = self._src or src
        self._submit(lambda: self._write_group(group, src, ready))

    def stop(self, reason: str) -> None:
        """Write no more groups (a cancel, or the job settled); the job ends as `reason`."""
        self._stopped = self._stopped or reason

    def _write_group(self, group: int, src: tuple[int, ...], ready: Any) -> None:  # NIXL thread
        job = self.job
        if self._error is not None or self._stopped:
            return
        if time.time() >= job.deadline_unix_s:
            self._stopped = "deadline"
            return
        if len(src) != len(job.dest_block_ids) or src != self._src:
            self._error = TransferError(f"{len(src)} source blocks for {len(job.dest_block_ids)}")
            return
        layers = group_layers(self.groups, group)
        try:
            stats = self._faults.write_layers(
                self._connector, job.request_id, job.dest_agent_name, src, job.dest_block_ids,
                layers, self._deadline, ready,
            )  # fmt: skip
            if job.with_checksums:
                self._checksums[group] = self._connector.layer_checksums(src, layers)
        except TransferError as err:
            self._error = err
            return
        self._written.append((stats, time.monotonic()))
        log.debug("layer group written request_id=%s group=%d layers=%d-%d bytes=%d",
                  job.request_id, group, layers[0], layers[1] - 1, stats.num_bytes)  # fmt: skip

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
        when the engine handed over no group for these blocks (the caller writes the whole
        prompt).
        Raises TransferError when a group failed, Refused when the groups stopped."""
        computed = time.monotonic()
        await asyncio.wrap_future(self._submit(lambda: None))  # every group queued has run
        if self._error is not None:
            raise self._error
        if self._stopped:
            raise Refused(self._stopped)
        if self._src != tuple(src) or len(self._written) != len(self.groups):
            return None
        sums = tuple(s for group in self._checksums for s in group)
        note = notification(sums)
        job, connector, faults = self.job, self._connector, self._faults
        peer = job.dest_agent_name
        sent = self._submit(lambda: faults.notify(connector, job.request_id, peer, note))
        await asyncio.wrap_future(sent)
        num_bytes = sum(stats.num_bytes for stats, _ in self._written)
        early = sum(stats.num_bytes for stats, landed in self._written if landed <= computed)
        total = TransferStats(
            num_bytes,
            sum(stats.seconds for stats, _ in self._written),
            self._written[-1][0].transport,
        )
        tail_s = max(0.0, self._written[-1][1] - computed)
        return LayeredStats(
            total, len(self.groups), tail_s, early / num_bytes if num_bytes else 0.0
        )
