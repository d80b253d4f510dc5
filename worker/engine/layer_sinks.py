"""Layer sinks: what a layer-wise KV transfer (docs/layerwise.md) hears from the engine.

A prefill worker registers a sink for a request before submitting it; the model runner calls it
on the engine thread after each decoder layer of every step that computes part of that
request's prompt, with the request's block ids, the prompt's tokens the step starts and ends at
(the end is the whole prompt in its last step), and, on CUDA, an event recorded on the
compute stream right after the layer, so the sink's transfer can wait for exactly that work and
the engine never waits for the transfer. A sink is taken when its prompt's last step starts.
Sinks are added and discarded from the event loop's thread and taken on the engine thread: one
dict operation each, atomic under the GIL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvrail.worker.engine.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

LayerSink = Callable[[int, Sequence[int], Any, tuple[int, int]], None]
"""`sink(num_layers_done, block_ids, ready, tokens)`: the first `num_layers_done` layers of a
step of the request's prompt ran; the step computes the prompt's tokens `[start, end)` (those
before `start` had their KV already); `block_ids` is its block table; `ready` a CUDA event
recorded after those layers (None on CPU, where the layers' KV is written when the call comes).
It must return at once."""


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
        """The model's `after_layer` for this step (None: no watched request's prompt is in it);
        takes the sinks of the prompts it completes."""
        due: list[tuple[str, LayerSink, list[int], tuple[int, int]]] = []
        for item in out.prefills:
            rid = item.request.request_id
            sink = self._sinks.get(rid)
            if sink is None or item.request.num_output_tokens:
                continue
            if item.samples:  # the prompt's last step
                self._sinks.pop(rid, None)
            tokens = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            due.append((rid, sink, list(item.block_ids), tokens))
        if not due:
            return None

        def after_layer(num_layers_done: int) -> None:
            ready = None
            if cuda:
                ready = torch.cuda.Event()
                ready.record()
            for rid, sink, block_ids, tokens in due:
                try:
                    sink(num_layers_done, block_ids, ready, tokens)
                except Exception:  # a sink's bug must not fail the step of every request
                    log.exception("layer sink failed request_id=%s", rid)

        return after_layer
