"""One step's grammar masks: filled on the CPU, copied to the device without waiting for it.

A step whose scheduler output has constrained rows (`SchedulerOutput.has_grammar`) gets, before
its sampling is queued, one int32 bitmask row per constrained request (bit t of a row set: token
t allowed; llguidance's layout) and the index of that request's row in the step's logits
(`TokenMasks`); `Sampler` applies them on the device (`kvrail.kernels.dispatch
.apply_token_bitmask`) and leaves every other row untouched. A step without constrained rows
never gets here.

`MaskFiller.fill` asks llguidance to fill the rows with its thread pool (`LLExecutor`: native
threads, the GIL released), handing it the rows grouped by the start their matcher was copied
from (`Request.grammar_group`: the threads take contiguous runs of rows, and rows that share a
lexer fill in turn, see `kvrail.worker.engine.grammar`), into a pinned host buffer, then applies
each row's hold-backs (`Grammars.hold_back_ids`) and queues the copy to the device. The buffer
is reused: a fill first waits for the previous copy out of it (it has long finished: the
pipeline fills a step only after the step before it has resolved). The host time of every fill
is recorded (`kvrail_grammar_mask_fill_seconds`): with asynchronous scheduling it runs while the
device runs the step's forward pass (`step_pipeline`), and the step waits for it only where it
takes longer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import fill_next_token_bitmask_par

from kvrail.worker import metrics
from kvrail.worker.engine.grammar import Grammars, fill_threads
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.staging import to_device


@dataclass(frozen=True, slots=True)
class TokenMasks:
    """A step's constrained rows (`rows`, int64 [m]: indexes into the step's logits) and their
    allowed tokens (`bitmask`, int32 [m, words]), on the logits' device."""

    rows: torch.Tensor
    bitmask: torch.Tensor


def hold_back(row: np.ndarray, token_ids: Iterable[int]) -> None:
    """Clear the bits of `token_ids` in one mask row (int32 words), unless that would leave no
    token allowed: the grammar then wins (it may only end here)."""
    words = row.view(np.uint32)
    ids = [t for t in token_ids if t < 32 * words.shape[0]]
    if not ids:
        return
    index = np.asarray(ids, dtype=np.int64) >> 5
    saved = words[index].copy()
    for t in ids:
        words[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))
    if not words.any():
        words[index] = saved


class MaskFiller:
    """Fills the grammar masks of a step's constrained rows; see the module docstring.
    `num_threads`: llguidance's fill threads (0: its default, 80% of the CPUs, at most 32)."""

    def __init__(self, grammars: Grammars, device: torch.device, num_threads: int = 0) -> None:
        self.grammars = grammars
        self.device = device
        self.num_threads = num_threads
        self._executor: LLExecutor | None = None
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def fill(self, requests: Sequence[Request]) -> TokenMasks | None:
        """The masks of the rows (one per request, in row order) whose request has a grammar
        and is still running; None when there is none. A request whose matcher cannot be made
        gets no mask: its token breaks its grammar as it joins, which fails it."""
        started = time.perf_counter()
        rows: list[int] = []
        matchers: list[tuple[int, LLMatcher, int]] = []
        live = [  # a finished request's token here is discarded
            (i, request) for i, request in enumerate(requests)
            if request.sampling_params.grammar is not None and not request.is_finished
        ]  # fmt: skip
        self.grammars.spread(request for _, request in live)
        for i, request in live:
            matcher = self.grammars.matcher(request)
            if matcher is not None:
                matchers.append((request.grammar_group, matcher, len(rows)))
                rows.append(i)
        if not rows:
            return None
        host = self._buffer(len(rows))
        bits = host.numpy()
        if self._executor is None:
            self._executor = LLExecutor(fill_threads(self.num_threads))
        matchers.sort(key=lambda m: m[0])
        fill_next_token_bitmask_par(self._executor, [(m, k) for _, m, k in matchers], bits)
        for k, i in enumerate(rows):
            ids = self.grammars.hold_back_ids(requests[i])
            if ids:
                hold_back(bits[k], ids)
        masks = TokenMasks(to_device(np.asarray(rows, dtype=np.int64), self.device),
                           self._to_device(host))  # fmt: skip
        metrics.GRAMMAR_MASK_FILL_SECONDS.observe(time.perf_counter() - started)
        return masks

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The first `num_rows` rows of the host buffer, free to be written."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy out of it is done
            self._copied = None
        if self._host is None or self._host.shape[0] < num_rows:
            size = max(64, 1 << (num_rows - 1).bit_length())
            self._host = torch.empty(
                (size, self.grammars.num_words), dtype=torch.int32,
                pin_memory=self.device.type == "cuda",
            )  # fmt: skip
        return self._host[:num_rows]

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":  # a copy: the buffer is the next step's
            return torch.from_numpy(host.numpy().copy())  # (torch's clone: OpenMP threads)
        on_device = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return on_device
