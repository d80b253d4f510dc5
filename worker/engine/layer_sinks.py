"""Layer sinks: what a layer-wise KV transfer (docs/layerwise.md) hears from the engine.

A prefill worker registers a sink for a request before submitting it; the model runner calls it
on the engine thread after each decoder layer of the step that completes that request's prompt
(the layers of earlier chunks are all written by then), with the request's block ids and, on
CUDA, an event recorded on the compute stream right after the layer, so the sink's transfer can
wait for exactly that work and the engine never waits for the transfer. A sink fires for one
step only: it is taken when that step starts. Sinks are added and discarded from the event
loop's thread and taken on the engine thread: one dict operation each, atomic under the GIL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvrail.worker.engine.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

LayerSink = Callable[[int, Sequence[int], Any], None]
"""`sink(num_layers_done, block_ids, ready)`: the first `num_layers_done` layers of the request's
last prefill step ran; `block_ids` is its block table; `ready` a CUDA event recorded after them
(None on CPU, where the layers' KV is written when the call comes). It must return at once."""


class LayerSinks:
    """The sinks of the requests a prefill worker writes layer by layer, by request id."""

    def __init__(self) -> None:
        self._sinks: dict[str, LayerSink] = {}

    def add(self, request_id: str, sink: LayerSink) -> None:
        self._sinks[request_id] = sink

    def discard(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    def __bool__(self) -> bool:
        return bool(self._sinks)

    def hook_for(self, out: SchedulerOutput, cuda: bool) -> Callable[[int], None] | None:
        """The model's `after_layer` for this step (None: no watched request completes its prompt
        in it); takes the sinks it will call."""
        due: list[tuple[str, LayerSink, list[int]]] = []
        for item in out.prefills:
            rid = item.request.request_id
            if item.samples and not item.request.num_output_tokens and rid in self._sinks:
                due.append((rid, self._sinks.pop(rid), list(item.block_ids)))
        if not due:
            return None

        def after_layer(num_layers_done: int) -> None:
            ready = None
            if cuda:
                ready = torch.cuda.Event()
                ready.record()
            for rid, sink, block_ids in due:
                try:
                    sink(num_layers_done, block_ids, ready)
                except Exception:  # a sink's bug must not fail the step of every request
                    log.exception("layer sink failed request_id=%s", rid)

        return after_layer
