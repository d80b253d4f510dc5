"""A vLLM pool's stream refuses what it cannot carry yet, before any server is sent anything
(the stream against stand-ins for vLLM servers is tests/integration/test_router_vllm.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import httpx
import pytest

from kvrail.messages import WorkerRecord
from kvrail.router.api.errors import dispatch_error
from kvrail.router.policy import Candidate, Decision, NoWorkerError
from kvrail.router.streams.job import DispatchError, Engine, Job
from kvrail.router.streams.vllm_options import VllmOptions
from kvrail.router.streams.vllm_stream import VllmStream
from kvrail.sampling import SamplingParams


class NoServers:
    """A pool without any ready vLLM server; counts what the stream asked of it."""

    max_attempts = 3

    def __init__(self) -> None:
        self.asked = 0

    def records(self) -> Mapping[str, WorkerRecord]:
        return {}

    def choose(self, job: Job, exclude: set[str], engines: tuple[Engine, ...]) -> Decision:
        self.asked += 1
        raise NoWorkerError("none")

    def prefill_candidates(self, fingerprint: str, engines: tuple[Engine, ...]) -> list[Candidate]:
        return []

    def count_in_flight(self, worker_id: str, delta: int) -> None:
        raise AssertionError("nothing was sent")


def _refused(request: httpx.Request) -> httpx.Response:
    raise AssertionError("nothing is sent to a vLLM server")


async def _first_error(logprobs: int | None) -> tuple[str, int]:
    workers = NoServers()
    async with httpx.AsyncClient(transport=httpx.MockTransport(_refused)) as http:
        job = Job("cmpl-1", (1, 2, 3), SamplingParams(max_tokens=4, logprobs=logprobs),
                  time.time() + 10)  # fmt: skip
        stream = VllmStream(workers, VllmOptions(http, "m"), job)
        with pytest.raises(DispatchError) as info:
            async for _ in stream:
                pass
        await stream.close()
    return info.value.code, workers.asked


def test_a_request_with_logprobs_is_a_400_naming_logprobs_and_reaches_no_server() -> None:
    for logprobs in (0, 5):
        assert asyncio.run(_first_error(logprobs)) == ("logprobs_unsupported", 0)
    assert asyncio.run(_first_error(None)) == ("no_worker", 1)  # the others go on to a server
    err = dispatch_error("logprobs_unsupported")
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "logprobs")
    assert err.code == "logprobs_unsupported"
    assert err.message == "logprobs are not supported for vLLM pools yet"
    assert dispatch_error("no_worker").param is None
