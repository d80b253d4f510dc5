"""The decode role's per-request stream (`_Stream`): the order of its events and what the first
one carries. Its outbox is a list here: the events' way onto NATS (one batch per router per step)
is the integration tests' (`tests/integration/test_worker_disaggregated.py`, `test_faults.py`)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from kvrail.messages import GenerateRequest
from kvrail.outputs import RequestOutput, TokenEvent
from kvrail.sampling import SamplingParams
from kvrail.worker.roles.decode import _Stream


class ListOutbox:
    def __init__(self) -> None:
        self.events: list[tuple[str, TokenEvent]] = []

    def add(self, subject: str, event: TokenEvent) -> None:
        self.events.append((subject, event))


def _stream() -> tuple[_Stream, ListOutbox]:
    request = GenerateRequest("r-1", (1, 2, 3), "_INBOX.r1", 2e9, SamplingParams(max_tokens=4))
    outbox = ListOutbox()
    stream = _Stream(outbox, request, "decode-0")  # type: ignore[arg-type]
    return stream, outbox


def _tokens(outbox: ListOutbox) -> list[tuple[int, tuple[int, ...], Any]]:
    return [
        (e.seq, e.output.token_ids, e.output.finish_reason or e.output.error)
        for _, e in outbox.events
    ]


async def test_updates_before_start_are_held_then_published_in_order() -> None:
    stream, outbox = _stream()
    stream.mode = "remote"
    stream.on_output(RequestOutput("r-1", (7,), num_cached_tokens=0))
    stream.on_output(RequestOutput("r-1", (8,)))
    assert outbox.events == []  # the task has not set the first event's fields yet
    stream.num_cached_tokens = 16  # as after a remote prefill's install
    stream.start()
    stream.on_output(RequestOutput("r-1", (9,), finish_reason="length"))
    assert _tokens(outbox) == [(0, (7,), None), (1, (8,), None), (2, (9,), "length")]
    first = outbox.events[0][1]
    assert (first.prefill_mode, first.output.num_cached_tokens, first.worker_id) == (
        "remote",
        16,
        "decode-0",
    )
    assert first.stages is not None
    assert all(subject == "_INBOX.r1" for subject, _ in outbox.events)
    assert outbox.events[1][1].stages is None and outbox.events[1][1].prefill_mode == ""
    assert stream.done.done() and stream.done.result() is None


async def test_a_local_prefill_times_its_compute_from_submit_to_the_first_update() -> None:
    stream, outbox = _stream()
    stream.mode = "local"
    stream.submitted = 100.0
    stream.first_output_at = 100.25  # the first update came before the task started the stream
    stream.held = [RequestOutput("r-1", (7,), num_cached_tokens=32)]
    stream.start()
    first = outbox.events[0][1]
    assert first.stages is not None and first.stages.prefill_compute_s == pytest.approx(0.25)
    assert first.output.num_cached_tokens == 32


async def test_nothing_follows_a_failure_and_a_failure_ends_the_stream_once() -> None:
    stream, outbox = _stream()
    stream.start()
    stream.on_output(RequestOutput("r-1", (7,)))
    stream.fail("cancelled")
    stream.on_output(RequestOutput("r-1", (8,)))  # a step that raced with the abort
    stream.fail("internal_error")
    assert _tokens(outbox) == [(0, (7,), None), (1, (), "cancelled")]
    assert stream.done.done()


async def test_an_error_update_is_the_last_event() -> None:
    stream, outbox = _stream()
    stream.start()
    stream.on_output(RequestOutput("r-1", (), error="deadline"))
    stream.on_output(RequestOutput("r-1", (5,)))
    assert _tokens(outbox) == [(0, (), "deadline")]
    assert stream.done.done()


async def test_a_recompute_under_another_engine_id_is_published_under_the_requests_id() -> None:
    """Beside a quarantined reservation the local recompute runs as `<id>~local`; its router
    knows the request by `<id>` alone."""
    stream, outbox = _stream()
    stream.start()
    stream.on_output(RequestOutput("r-1~local", (7,)))
    stream.on_output(RequestOutput("r-1~local", (8,), finish_reason="length"))
    assert [e.request_id for _, e in outbox.events] == ["r-1", "r-1"]
    assert _tokens(outbox) == [(0, (7,), None), (1, (8,), "length")]


async def test_a_failing_publish_fails_only_its_own_request() -> None:
    stream, outbox = _stream()
    stream.start()

    def broken(subject: str, event: TokenEvent) -> None:
        raise ValueError("a bug")

    outbox.add = broken  # type: ignore[method-assign]
    stream.on_output(
        RequestOutput("r-1", (7,))
    )  # the service's callback returns: other requests go on
    assert stream.done.done() and isinstance(stream.done.exception(), ValueError)


async def test_the_first_tokens_log_line_gives_the_requests_whole_time_in_the_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`in_worker_s` is logged (bench/sweep subtracts it from the client's TTFT) but is not a
    stage: the first event's stages and the stage metric do not carry it."""
    stream, outbox = _stream()
    stream.mode = "local"
    stream.arrived = time.monotonic() - 0.5
    stream.submitted = stream.arrived + 0.1
    with caplog.at_level(logging.INFO, logger="kvrail.worker.roles.decode"):
        stream.start()
        stream.on_output(RequestOutput("r-1", (7,), num_cached_tokens=0))
    [line] = [r.getMessage() for r in caplog.records if "first token" in r.getMessage()]
    logged = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    assert 0.5 <= float(logged["in_worker_s"]) < 5.0
    first = outbox.events[0][1]
    assert first.stages is not None and not hasattr(first.stages, "in_worker_s")
