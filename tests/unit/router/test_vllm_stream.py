"""A vLLM pool's stream refuses a sampling field it does not send vLLM, by name, before any
server is sent anything (the stream against stand-ins for vLLM servers is
tests/integration/test_router_vllm.py, against vLLM itself test_vllm_logprobs.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import pytest

from kvrail.messages import WorkerRecord
from kvrail.router.api.errors import dispatch_error
from kvrail.router.policy import Candidate, Decision, NoWorkerError
from kvrail.router.streams.job import DispatchError, Engine, Job
from kvrail.router.streams.vllm_options import VllmOptions
from kvrail.router.streams.vllm_stream import VllmStream
from kvrail.sampling import SamplingParams, TokenBias


class NoServers:
    """A pool without any ready vLLM server; counts what the stream asked of it."""

    max_attempts = 3

    def __init__(self) -> None:
        self.asked = 0

    def record(self, worker_id: str) -> WorkerRecord | None:
        return None

    def choose(self, job: Job, exclude: set[str], engines: tuple[Engine, ...]) -> Decision:
        self.asked += 1
        raise NoWorkerError("none")

    def prefill_candidates(self, fingerprint: str, engines: tuple[Engine, ...]) -> list[Candidate]:
        return []

    def prefill_worker_for(self, job: Job, decision: Decision) -> str:
        raise AssertionError("a vLLM stream never asks")

    def count_in_flight(self, worker_id: str, delta: int) -> None:
        raise AssertionError("nothing was sent")


def _refused(request: httpx.Request) -> httpx.Response:
    raise AssertionError("nothing is sent to a vLLM server")


@dataclass(frozen=True, slots=True)
class WithBeamWidth(SamplingParams):
    """kvrail's sampling parameters with one more field, as a later engine feature adds one:
    `protocol.CARRIED` does not name it."""

    beam_width: int = 1


async def _first_error(sampling: SamplingParams) -> tuple[str, str | None, int]:
    workers = NoServers()
    async with httpx.AsyncClient(transport=httpx.MockTransport(_refused)) as http:
        job = Job("cmpl-1", (1, 2, 3), sampling, time.time() + 10)
        stream = VllmStream(workers, VllmOptions(http, "m"), job)
        with pytest.raises(DispatchError) as info:
            async for _ in stream:
                pass
        await stream.close()
    return info.value.code, info.value.param, workers.asked


def test_a_field_vllm_is_not_sent_is_a_400_naming_it_and_reaches_no_server() -> None:
    refused = WithBeamWidth(max_tokens=4, beam_width=2)
    assert asyncio.run(_first_error(refused)) == ("unsupported_parameter", "beam_width", 0)
    echo = SamplingParams(max_tokens=4, prompt_logprobs=1)  # set by `echo` with `logprobs`
    assert asyncio.run(_first_error(echo)) == ("unsupported_parameter", "echo", 0)
    err = dispatch_error("unsupported_parameter", "echo")
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "echo")
    assert err.code == "unsupported_parameter"
    assert err.message == "vLLM pools do not take this parameter: 'echo'"
    assert dispatch_error("no_worker").param is None


def test_every_field_vllm_is_sent_goes_on_to_a_server_logprobs_and_logit_bias_included() -> None:
    carried = [
        WithBeamWidth(max_tokens=4),  # the extra field at its default: nothing refused
        SamplingParams(max_tokens=4, logprobs=0),
        SamplingParams(max_tokens=4, logprobs=20, logit_bias=(TokenBias(5, -100.0),)),
    ]
    for sampling in carried:
        assert asyncio.run(_first_error(sampling)) == ("no_worker", None, 1)
