"""Scheduling ahead (`async_scheduling`): the engine queues step k+1 before step k's tokens are
known. On the CPU nothing overlaps, but the bookkeeping is the same as on a GPU: these tests turn
it on there and check that it changes no output, finishes requests that stop on the token in
flight after exactly that token, and leaves every block accounted for (invariants after every
step, an empty engine at the end), through chunked prefill, prefix hits, preemption, seeded
sampling, stop tokens and aborts of requests in the step in flight."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvrail.sampling import SamplingParams, TokenBias
from kvrail.worker.engine.engine import LLMEngine
from kvrail.worker.engine.request import RequestStatus
from kvrail.worker.engine.scheduler import Scheduler
from kvrail.worker.engine.scheduler_output import SchedulerOutput
from kvrail.worker.testing import (
    assert_engine_empty,
    make_engine,
    make_request,
    make_scheduler,
    tiny_llama_config,
)

SHARED = list(range(3, 23))  # a 20-token prefix (5 blocks of 4) shared by some prompts


def _prompts() -> list[list[int]]:
    return [
        [5, 6, 7],
        SHARED + [40, 41],
        list(range(30, 75)),  # longer than the 16-token budget: chunked
        SHARED + [50],
        [9],
        list(range(60, 80)),
    ]


def _params(stop_tokens: dict[int, int]) -> list[SamplingParams]:
    params = []
    for i in range(len(_prompts())):
        extra: dict[str, Any] = {"temperature": 0.9, "seed": 7 + i} if i % 3 == 1 else {}
        if i % 4 == 2:  # penalties: scheduled ahead only once the token in flight is known
            extra.update(repetition_penalty=1.3, frequency_penalty=0.5)
        stops = (stop_tokens[i],) if i in stop_tokens else ()
        params.append(
            SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, stop_token_ids=stops, **extra)
        )
    return params


def _run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, tuple[list[int], str]]:
    requests = [
        engine.add_request(f"r{i}", prompt, p)
        for i, (prompt, p) in enumerate(zip(_prompts(), params, strict=True))
    ]
    outputs: dict[str, tuple[list[int], str]] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id not in outputs, "an output after the request finished"
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finished:
                assert output.finish_reason is not None
                outputs[output.request_id] = (tokens[output.request_id], output.finish_reason)
        engine.scheduler.check_invariants()
    assert_engine_empty(engine)
    engine.num_preemptions = sum(r.num_preemptions for r in requests)  # type: ignore[attr-defined]
    return outputs


def _engine(async_scheduling: bool, **overrides: Any) -> LLMEngine:
    values: dict[str, Any] = {"max_num_batched_tokens": 16, "async_scheduling": async_scheduling}
    values.update(overrides)
    engine: LLMEngine = make_engine(tiny_llama_config(), seed=3, **values)
    return engine


def _stop_tokens() -> dict[int, int]:
    """Stop token ids that end some requests early: a token each produced mid-way in a run
    without stops (so the run with them stops there, on a token that was in flight)."""
    free = _run(_engine(False), _params({}))
    return {i: free[f"r{i}"][0][2] for i in (0, 2, 5)}


def test_outputs_equal_the_synchronous_engine_with_stops_seeds_and_prefix_hits() -> None:
    params = _params(_stop_tokens())
    expected = _run(_engine(False), params)
    assert {reason for _, reason in expected.values()} == {"stop", "length"}
    assert _run(_engine(True), params) == expected


def test_outputs_equal_the_synchronous_engine_when_blocks_run_short() -> None:
    """19 blocks of 4 tokens: requests are preempted and recomputed (scheduling ahead gives up
    and resolves the step in flight first)."""
    params = _params(_stop_tokens())
    expected = _run(_engine(False, num_blocks=20), params)
    short = _engine(True, num_blocks=20)
    assert _run(short, params) == expected
    assert short.num_preemptions > 0  # type: ignore[attr-defined]


def test_an_abort_of_a_request_in_the_step_in_flight_frees_its_blocks_and_drops_its_token() -> None:
    engine = _engine(True)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request("gone", [5, 6, 7, 8, 9], params)
    kept_request = engine.add_request("kept", [11, 12], params)
    for _ in range(3):
        engine.step()
    assert (
        engine.pipeline._in_flight is not None and "gone" in engine.pipeline._in_flight.sampled.rows
    )
    assert engine.abort("gone")
    engine.scheduler.check_invariants()
    kept = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        assert all(o.request_id == "kept" for o in outputs)
        kept.extend(outputs)
    assert kept[-1].finished and len(kept_request.output_token_ids) == 20
    assert_engine_empty(engine)


# -- the scheduler alone, with a random workload and one step always in flight ------------------


def _resolve(scheduler: Scheduler, out: SchedulerOutput, stopping: set[str]) -> None:
    """Sample 50 for every request, or 51 (a stop token) for those in `stopping`."""
    sampled = {
        s.request.request_id: 51 if s.request.request_id in stopping else 50
        for s in out.decodes + out.prefills
    }
    scheduler.update_from_output(out, sampled)


REQUEST = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(1, 18),  # max_tokens
    st.integers(0, 6),  # stop after this many outputs (6: never)
    st.sampled_from(["local", "remote", "abort"]),
)


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(REQUEST, min_size=1, max_size=8),
    num_blocks=st.integers(13, 24),
    budget=st.integers(1, 24),
)
def test_random_workloads_scheduled_ahead_keep_every_block_accounted_for(
    requests: list[tuple[int, int, int, str]], num_blocks: int, budget: int
) -> None:
    scheduler = make_scheduler(
        num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, max_model_len=48
    )
    prefix = list(range(10, 40))
    admitted = []
    for n, m, stop_after, kind in requests:
        request = make_request(prompt_token_ids=prefix[:n], max_tokens=m, stop_token_ids=(51,))
        if kind == "remote" and scheduler.reserve_remote(request) is not None:
            scheduler.install_remote(request.request_id, 70)  # its first output, never a stop
            stop_after = max(stop_after, 1)
        else:
            scheduler.add_request(request)
        admitted.append((request, stop_after, kind))
    in_flight: SchedulerOutput | None = None
    for step in range(2000):
        if not scheduler.requests:
            break
        stopping = {r.request_id for r, after, _ in admitted if r.num_output_tokens + 1 > after}
        if step == 3:
            for request, _, kind in admitted:
                if kind == "abort" and not request.is_finished:
                    scheduler.abort(request.request_id)
        if in_flight is None:
            in_flight = scheduler.schedule()
        ahead = scheduler.schedule_ahead()
        scheduler.check_invariants()
        if ahead is None:
            event("scheduling ahead gave up")
            _resolve(scheduler, in_flight, stopping)
            in_flight = scheduler.schedule()
        else:
            assert ahead.num_batched_tokens <= budget
            if any(s.token_on_device for s in ahead.decodes):
                event("a decode fed from the device")
            _resolve(scheduler, in_flight, stopping)
            in_flight = ahead
        scheduler.check_invariants()
    else:
        raise AssertionError("no progress")
    for request, stop_after, kind in admitted:
        if request.status is RequestStatus.FINISHED_ABORTED:
            assert kind == "abort"
            continue
        limit = request.sampling_params.max_tokens
        assert request.num_output_tokens == min(limit, stop_after + 1)
        assert request.num_in_flight == 0 or request.is_finished
    assert_engine_empty(scheduler)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_outputs_equal_the_synchronous_engine_with_graphs() -> None:
    """Where it overlaps for real: CUDA graphs for the decode steps, inputs fed from the device."""
    with torch.device("cuda"):
        params = _params(_stop_tokens())
        expected = _run(_engine(False, max_num_seqs=8), params)
        overlapped = _engine(True, max_num_seqs=8)
    assert overlapped.runner.graphs is not None
    assert _run(overlapped, params) == expected


def _with_logprobs(engine: LLMEngine) -> dict[str, list[Any]]:
    """Eight requests, greedy and seeded, half asking for 3 logprobs, one forced by a +100 bias,
    three scoring their (chunked) prompts: each request's tokens and logprob entries, and under
    `<id>:prompt` its prompt's scores."""
    for i in range(8):
        params = SamplingParams(
            max_tokens=10, ignore_eos=True, logprobs=3 if i % 2 else None,
            temperature=0.0 if i < 4 else 1.0, seed=i,
            logit_bias=(TokenBias(5, 100.0),) if i == 7 else (),
            prompt_logprobs=2 if i % 3 == 0 else None,
        )  # fmt: skip
        engine.add_request(f"lp{i}", list(range(10 + i, 30 + i)), params)
    got: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            entries = output.logprobs or (None,) * len(output.token_ids)
            got.setdefault(output.request_id, []).extend(
                zip(output.token_ids, entries, strict=True)
            )
            if output.prompt_logprobs:
                got[f"{output.request_id}:prompt"] = list(output.prompt_logprobs)
    assert_engine_empty(engine)
    return got


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ])],
)  # fmt: skip
def test_logprobs_and_logit_bias_are_the_same_scheduled_ahead(device: str) -> None:
    """With the next step queued before the last one's tokens are read (and CUDA graphs on a
    GPU), every asking row's logprob entries and prompt scores are the synchronous engine's;
    rows that did not ask get none, and the biased row is forced."""
    with torch.device(device):
        expected = _with_logprobs(_engine(False, max_num_seqs=8))
        got = _with_logprobs(_engine(True, max_num_seqs=8))
    prompts = sorted(r for r in got if r.endswith(":prompt"))
    assert prompts == ["lp0:prompt", "lp3:prompt", "lp6:prompt"]
    for rid in prompts:
        scores, want = got.pop(rid), expected.pop(rid)
        assert [e.token_id for e in scores] == [e.token_id for e in want]
        assert len(scores) == 19 and all(len(e.top_token_ids) == 2 for e in scores)
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(scores, want, strict=True))
    assert [[t for t, _ in got[r]] for r in sorted(got)] == [
        [t for t, _ in expected[r]] for r in sorted(expected)
    ]
    for rid, entries in got.items():
        asked = int(rid[2:]) % 2 == 1
        assert all((lp is not None) == asked for _, lp in entries)
        for (token, lp), (_, want) in zip(entries, expected[rid], strict=True):
            if lp is not None:
                assert lp.token_id == token and lp.top_token_ids == want.top_token_ids
                assert abs(lp.logprob - want.logprob) < 1e-4
    assert {t for t, _ in got["lp7"]} == {5}
