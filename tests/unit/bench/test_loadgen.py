"""The pure parts of bench/loadgen/: lengths, arrival schedules, prompts, statistics and SLOs."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from kvrail.local.procs import ProcessFailed, free_port
from kvrail.testing.scripts import load_script

BENCH = Path(__file__).resolve().parents[3] / "bench"


lg: Any = load_script("kvrail_bench_loadgen", BENCH / "loadgen" / "__init__.py")
cost: Any = load_script(
    "kvrail_bench_loadgen_cost", BENCH / "studies" / "client" / "loadgen_cost.py"
)


def result(
    chunk_times: list[float], output_tokens: int, *, start: float = 0.0, end: float | None = None,
    warmup: bool = False, error: str | None = None, index: int = 0,
) -> Any:  # fmt: skip
    end_s = start + (chunk_times[-1] if chunk_times else 0.1) if end is None else end
    r = lg.RequestResult(index, warmup, start, end_s, list(chunk_times), output_tokens)
    r.error = error
    r.finish_reason = None if error else "length"
    return r


# -- lengths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "low", "high"), [("128", 128, 128), ("64-256", 64, 256), (" 7-7 ", 7, 7)]
)
def test_a_length_spec_is_fixed_or_a_uniform_range(spec: str, low: int, high: int) -> None:
    lengths = lg.Lengths.parse(spec)
    assert (lengths.low, lengths.high) == (low, high)
    assert lg.Lengths.parse(str(lengths)) == lengths


@pytest.mark.parametrize("spec", ["", "0", "-5", "9-3", "a", "1-2-3", "2.5"])
def test_an_invalid_length_spec_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="length"):
        lg.Lengths.parse(spec)


def test_uniform_lengths_stay_in_range_and_reach_both_ends() -> None:
    rng = random.Random(1)
    samples = [lg.Lengths(10, 14).sample(rng) for _ in range(500)]
    assert set(samples) == {10, 11, 12, 13, 14}
    assert {lg.Lengths(9, 9).sample(rng) for _ in range(20)} == {9}


# -- arrivals --------------------------------------------------------------------------------------


def test_poisson_arrivals_have_the_rate_and_exponential_gaps() -> None:
    times = lg.arrival_times("poisson", 2.0, seed=3, num_requests=20_000)
    assert len(times) == 20_000 and times[0] == 0.0
    gaps = np.diff(times)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.5, rel=0.03)
    # Exponential: standard deviation equals the mean, and P(gap > mean) = 1/e.
    assert gaps.std() == pytest.approx(0.5, rel=0.05)
    assert (gaps > 0.5).mean() == pytest.approx(np.exp(-1), abs=0.02)


def test_arrivals_are_reproducible_from_the_seed_and_differ_across_seeds() -> None:
    a = lg.arrival_times("poisson", 1.0, seed=5, num_warmup=2, num_requests=50)
    assert a == lg.arrival_times("poisson", 1.0, seed=5, num_warmup=2, num_requests=50)
    assert a != lg.arrival_times("poisson", 1.0, seed=6, num_warmup=2, num_requests=50)


def test_constant_arrivals_are_evenly_spaced_and_warmup_comes_first() -> None:
    times = lg.arrival_times("constant", 4.0, seed=0, num_warmup=3, num_requests=5)
    assert times == pytest.approx([i * 0.25 for i in range(8)])


def test_a_duration_counts_arrivals_from_the_first_measured_one() -> None:
    times = lg.arrival_times("constant", 2.0, seed=0, num_warmup=1, duration_s=5.0)
    measured = times[1:]
    assert measured == pytest.approx([0.5 + 0.5 * i for i in range(10)])  # [0.5, 5.5)
    poisson = lg.arrival_times("poisson", 3.0, seed=1, num_warmup=4, duration_s=600.0)
    assert all(t < poisson[4] + 600.0 for t in poisson)
    assert len(poisson) - 4 == pytest.approx(1800, rel=0.08)


def test_an_infinite_rate_sends_everything_at_once() -> None:
    assert (
        lg.arrival_times("poisson", float("inf"), seed=0, num_warmup=1, num_requests=4) == [0.0] * 5
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"process": "closed", "rate": 1.0, "num_requests": 2}, "open-loop"),
        ({"process": "poisson", "rate": 0.0, "num_requests": 2}, "rate"),
        ({"process": "poisson", "rate": -1.0, "num_requests": 2}, "rate"),
        ({"process": "poisson", "rate": 1.0}, "exactly one"),
        ({"process": "poisson", "rate": 1.0, "num_requests": 2, "duration_s": 3.0}, "exactly one"),
        ({"process": "poisson", "rate": float("inf"), "duration_s": 3.0}, "finite"),
        ({"process": "constant", "rate": 1.0, "duration_s": 0.0}, "positive"),
        ({"process": "constant", "rate": 1.0, "num_requests": 0}, "num_requests"),
        ({"process": "constant", "rate": 1.0, "num_requests": 1, "num_warmup": -1}, "num_warmup"),
    ],
)
def test_invalid_schedules_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lg.arrival_times(seed=0, **kwargs)


# -- prompts ---------------------------------------------------------------------------------------


def test_words_are_distinct_and_single_words() -> None:
    assert len(lg.WORDS) == len(set(lg.WORDS)) >= 200
    assert all(w.isalpha() and w.islower() for w in lg.WORDS)


def test_requests_share_exactly_their_system_prompt() -> None:
    workload = lg.Workload(
        prompt_tokens=lg.Lengths(5, 20), output_tokens=lg.Lengths(16, 16), num_prefixes=4,
        prefix_tokens=400, seed=9,
    )  # fmt: skip
    prefixes = lg.system_prompts(workload)
    assert len(set(prefixes)) == 4
    assert all(len(p.split()) == 400 for p in prefixes)
    # Distinct from the first block on, so no two prefixes share a cached block.
    assert len({tuple(p.split()[:8]) for p in prefixes}) == 4
    requests = [lg.make_request(workload, prefixes, i, i < 2) for i in range(200)]
    assert [r.is_warmup for r in requests[:3]] == [True, True, False]
    assert {r.prefix_id for r in requests} == {0, 1, 2, 3}
    for r in requests:
        assert r.system == prefixes[r.prefix_id]
        assert 5 <= len(r.user.split()) <= 20 and r.max_tokens == 16
        assert r.approx_prompt_tokens == 400 + len(r.user.split())
        assert set(r.user.split()) <= set(lg.WORDS)
    assert len({r.user for r in requests}) == 200


def test_request_i_depends_only_on_the_seed_and_i() -> None:
    workload = lg.Workload(num_prefixes=3, prefix_tokens=50, seed=4)
    prefixes = lg.system_prompts(workload)
    alone = lg.make_request(workload, prefixes, 17, False)
    assert [lg.make_request(workload, prefixes, i, False) for i in range(20)][17] == alone
    # Prefix k does not depend on how many prefixes there are.
    more = lg.system_prompts(lg.Workload(num_prefixes=5, prefix_tokens=50, seed=4))
    assert more[:3] == prefixes
    other_seed = lg.Workload(num_prefixes=3, prefix_tokens=50, seed=5)
    assert lg.make_request(other_seed, lg.system_prompts(other_seed), 17, False) != alone


def test_without_shared_prefixes_there_is_no_system_prompt() -> None:
    workload = lg.Workload(prompt_tokens=lg.Lengths(30, 30))
    r = lg.make_request(workload, lg.system_prompts(workload), 0, False)
    assert r.system is None and r.prefix_id is None and r.approx_prompt_tokens == 30


def test_a_long_context_fraction_mixes_in_long_prompts() -> None:
    workload = lg.Workload(
        prompt_tokens=lg.Lengths(10, 20), long_context_fraction=0.2,
        long_context_tokens=lg.Lengths(3000, 4000), seed=2,
    )  # fmt: skip
    requests = [lg.make_request(workload, (), i, False) for i in range(1000)]
    long = [r for r in requests if r.is_long]
    assert len(long) / len(requests) == pytest.approx(0.2, abs=0.04)
    assert all(3000 <= r.approx_prompt_tokens <= 4000 for r in long)
    assert all(10 <= r.approx_prompt_tokens <= 20 for r in requests if not r.is_long)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_prefixes": 2}, "both"),
        ({"prefix_tokens": 100}, "both"),
        ({"num_prefixes": -1, "prefix_tokens": 10}, ">= 0"),
        ({"long_context_fraction": 0.5}, "needs long_context_tokens"),
        ({"long_context_fraction": 1.5, "long_context_tokens": lg.Lengths(9, 9)}, "in \\[0, 1\\]"),
    ],
)
def test_inconsistent_workloads_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lg.Workload(**kwargs)


# -- statistics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_agrees_with_numpys_linear_method(n: int) -> None:
    values = [random.Random(n).expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert lg.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_none_and_q_is_checked() -> None:
    assert lg.percentile([], 50) is None
    assert lg.distribution([])["p99"] is None
    with pytest.raises(ValueError, match="not in"):
        lg.percentile([1.0], 101)


def test_ttft_gaps_and_tpot_of_one_request() -> None:
    r = result([0.5, 0.6, 0.8, 0.9], output_tokens=5, start=2.0, end=3.0)
    assert r.ttft_s == 0.5
    assert r.gaps_s == pytest.approx([0.1, 0.2, 0.1])
    assert r.e2e_s == pytest.approx(1.0)
    assert r.tpot_s == pytest.approx((1.0 - 0.5) / 4)  # usage counts 5 tokens in 4 chunks
    assert result([0.5], output_tokens=1).tpot_s is None
    assert result([], output_tokens=0, error="APIConnectionError").ttft_s is None


def test_the_itl_slo_uses_the_requests_p99_or_its_max_gap() -> None:
    # 100 gaps of 10 ms and one of 1 s: the max breaks a 0.2 s bound, the p99 does not.
    times = [0.1 + 0.01 * i for i in range(101)]
    times.append(times[-1] + 1.0)
    r = result(times, output_tokens=102)
    assert lg.request_itl_s(r, "max") == pytest.approx(1.0)
    assert lg.request_itl_s(r, "p99") == pytest.approx(0.01)  # 101 gaps: p99 is the 100th
    assert lg.meets_slo(r, lg.Slo(itl_s=0.2, itl_stat="p99"))
    assert not lg.meets_slo(r, lg.Slo(itl_s=0.2, itl_stat="max"))


@pytest.mark.parametrize(
    ("slo", "ok"),
    [
        ({}, True),
        ({"ttft_s": 0.5}, True),
        ({"ttft_s": 0.49}, False),
        ({"itl_s": 0.25}, True),
        ({"itl_s": 0.24}, False),
        ({"tpot_s": 0.125}, True),
        ({"tpot_s": 0.12}, False),
        ({"ttft_s": 1.0, "itl_s": 1.0, "tpot_s": 0.1}, False),
    ],
)
def test_a_request_meets_the_slo_only_within_every_bound(slo: dict[str, float], ok: bool) -> None:
    r = result([0.5, 0.75, 0.875, 1.0], output_tokens=5)  # gaps 0.25, 0.125, 0.125; tpot 0.125
    assert lg.meets_slo(r, lg.Slo(**slo, itl_stat="max")) is ok


def test_failed_requests_never_meet_an_slo_and_gapless_ones_meet_the_itl_bound() -> None:
    assert not lg.meets_slo(result([0.1], 1, error="RateLimitError(429)"), lg.Slo())
    assert lg.meets_slo(result([0.1], 1), lg.Slo(itl_s=0.001, tpot_s=0.001))


def test_summary_excludes_warmup_and_counts_errors_goodput_and_rates() -> None:
    results = [
        result([0.2, 0.3], 2, start=0.0, warmup=True, index=0),  # excluded
        result([1.0, 1.1, 1.3], 3, start=1.0, index=1),  # ttft 1.0: misses a 0.6 s SLO
        result([0.5, 0.6], 2, start=2.0, index=2),
        result([0.4, 0.5, 0.6, 0.7], 4, start=3.0, end=5.0, index=3),  # ends last, at 5.0
        result([], 0, start=4.0, end=4.5, error="APIConnectionError", index=4),
    ]
    s = lg.summarize(results, lg.Slo(ttft_s=0.6))
    assert (s["num_requests"], s["num_warmup"], s["num_completed"], s["num_errors"]) == (4, 1, 3, 1)
    assert s["errors"] == {"APIConnectionError": 1}
    assert s["window_s"] == pytest.approx(4.0)  # first measured send 1.0, last end 5.0
    assert s["arrival_rate_per_s"] == pytest.approx(3 / 3.0)  # 4 sends over 3 s
    assert s["requests_per_s"] == pytest.approx(3 / 4.0)
    assert s["output_tokens_per_s"] == pytest.approx(9 / 4.0)
    assert s["ttft_s"]["count"] == 3 and s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["itl_s"]["count"] == 2 + 1 + 3  # every gap of the measured requests, pooled
    assert s["itl_s"]["p50"] == pytest.approx(0.1)
    assert s["tpot_s"]["count"] == 3
    assert s["goodput"]["num_good"] == 2
    assert s["goodput"]["requests_per_s"] == pytest.approx(2 / 4.0)
    assert s["goodput"]["attainment"] == pytest.approx(2 / 4)
    for metric in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        d = s[metric]
        assert d["p50"] <= d["p90"] <= d["p99"]


def test_summary_of_nothing_measured_has_no_rates() -> None:
    s = lg.summarize([result([0.1], 1, warmup=True)], lg.Slo())
    assert s["num_requests"] == 0 and s["requests_per_s"] is None
    assert s["goodput"]["attainment"] is None


# -- streamed chunks, command line, report ---------------------------------------------------------


def test_a_chat_streams_role_only_first_chunk_carries_no_text() -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk.model_validate({
            "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })  # fmt: skip

    assert lg._chunk_text(chunk({"role": "assistant", "content": ""})) == ("", None)
    assert lg._chunk_text(chunk({"content": " Paris"})) == (" Paris", None)
    assert lg._chunk_text(chunk({}, "stop")) == ("", "stop")
    completion = Completion.model_validate({
        "id": "c", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": " is", "finish_reason": "length", "logprobs": None}],
    })  # fmt: skip
    assert lg._chunk_text(completion) == (" is", "length")


def test_rates_make_open_loop_points_and_concurrency_closed_loop_ones() -> None:
    args = lg.parse_args(["--url", "http://x/v1", "--rates", "0.5,1,inf", "--duration-s", "30"])
    points = lg.load_points(args)
    assert [(p.arrival, p.rate, p.duration_s, p.num_requests) for p in points] == [
        ("poisson", 0.5, 30.0, None), ("poisson", 1.0, 30.0, None),
        ("poisson", float("inf"), 30.0, None),
    ]  # fmt: skip
    args = lg.parse_args(["--url", "http://x/v1", "--concurrency", "1,4", "--warmup", "0"])
    assert [(p.arrival, p.concurrency, p.num_requests) for p in lg.load_points(args)] == [
        ("closed", 1, 20),
        ("closed", 4, 20),
    ]
    with pytest.raises(SystemExit):
        lg.parse_args(["--url", "u", "--rates", "1", "--concurrency", "2"])


def test_the_report_prints_a_table_and_plots_two_pngs(tmp_path: Path) -> None:
    points = []
    for rate in (0.5, 1.0):
        results = [result([0.2, 0.3, 0.45], 3, start=i / rate, index=i) for i in range(5)]
        point = lg.LoadPoint("poisson", rate=rate, num_requests=5)
        points.append({"label": point.label, "point": {"rate": rate},
                       "summary": lg.summarize(results, lg.Slo(ttft_s=1.0))})  # fmt: skip
    text = lg.table(points)
    assert "poisson 0.5/s" in text and "200/200/200" in text  # TTFT p50/p90/p99 in ms
    paths = lg.plot(points, str(tmp_path / "run"))
    assert [p.name for p in paths] == ["run-latency.png", "run-goodput.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


# -- several client processes ----------------------------------------------------------------------


def test_shards_split_the_schedule_round_robin_with_nothing_lost_or_sent_twice() -> None:
    for num_shards in (1, 2, 3, 8):
        owners = [
            [k for k in range(num_shards) if lg.in_shard(i, k, num_shards)] for i in range(50)
        ]
        assert all(len(o) == 1 for o in owners)
        counts = [sum(o == [k] for o in owners) for k in range(num_shards)]
        assert max(counts) - min(counts) <= 1


def test_a_workload_survives_the_trip_to_a_client_process() -> None:
    workload = lg.Workload(lg.Lengths(3, 9), lg.Lengths(4, 4), 2, 5, 0.25, lg.Lengths(50, 60), 7)
    assert lg._workload_from(asdict(workload)) == workload


def test_client_processes_send_the_whole_schedule_through_the_real_openai_client(
    tmp_path: Path,
) -> None:
    """Two client processes, each with a server replica of its own (two stand-ins), send every
    request of the schedule once, at its time."""
    # bench/studies/client/loadgen_cost.py's stand-in: an OpenAI-style SSE stream of 5 fixed
    # chunks, its response id naming its port (the thing under test is the client side)
    started = [_standin(tmp_path, 5, 5.0), _standin(tmp_path, 5, 5.0)]
    ports = [port for port, _ in started]
    standins = [standin for _, standin in started]
    try:
        target = lg.Target(f"http://127.0.0.1:{ports[0]}/v1", "standin", timeout_s=30.0)
        replicas = [f"http://127.0.0.1:{ports[1]}/v1"]
        workload = lg.Workload(lg.Lengths(4, 4), lg.Lengths(5, 5), seed=3)
        point = lg.LoadPoint("poisson", rate=50.0, num_requests=7, num_warmup=1)
        measured = lg.run_point_measured(target, workload, point, show_progress=False,
                                         processes=2, replicas=replicas)  # fmt: skip
        results, busy = asyncio.run(measured)
        times = lg.arrival_times("poisson", 50.0, 3, num_warmup=1, num_requests=7)
        closed = lg.LoadPoint("closed", concurrency=2, num_requests=2)
        with pytest.raises(ValueError, match="open loop"):
            asyncio.run(lg.run_point(target, workload, closed, show_progress=False, processes=2))
    finally:
        for standin in standins:
            standin.stop()
    assert [r.index for r in results] == list(range(8))
    assert [r.is_warmup for r in results] == [True] + [False] * 7
    assert all(r.error is None and len(r.chunk_times_s) == 5 for r in results)
    assert all(r.output_tokens == 5 and r.finish_reason == "length" for r in results)
    # request i went from client process i % 2 to that process's replica
    assert [r.response_id for r in results] == [
        f"chatcmpl-standin-{ports[i % 2]}" for i in range(8)
    ]
    # sent on one schedule from one start: each send is at its time, give or take the scheduling
    assert max(abs(r.start_s - at) for r, at in zip(results, times, strict=True)) < 0.25
    assert 0.0 < busy < 1.5  # the busiest client process's CPU over its wall time


_KILLED_PARENT = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
import loadgen as lg
target = lg.Target(sys.argv[2], "standin", timeout_s=60.0)
workload = lg.Workload(lg.Lengths(4, 4), lg.Lengths(400, 400), seed=3)
point = lg.LoadPoint("poisson", rate=20.0, num_requests=6, num_warmup=0)
asyncio.run(lg.run_point(target, workload, point, show_progress=False, processes=2))
"""


def test_client_processes_end_when_the_load_generator_is_killed(tmp_path: Path) -> None:
    """SIGKILL gives the load generator no chance to stop its client processes: they see their
    stdin end and stop in the middle of their streams."""
    port, standin = _standin(tmp_path, 400, 50.0)  # 20 s a stream
    parent = subprocess.Popen(
        [sys.executable, "-P", "-c", _KILLED_PARENT, str(BENCH),
         f"http://127.0.0.1:{port}/v1"],
    )  # fmt: skip
    try:
        children: list[int] = []
        deadline = time.monotonic() + 60
        while len(children) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            path = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
            children = [int(c) for c in path.read_text().split()] if path.exists() else []
        assert len(children) == 2, "the load generator never started its client processes"
        time.sleep(3)  # they are ready, and streaming
        assert all(_alive(pid) for pid in children)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "a client process outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        standin.stop()


def _standin(tmp_path: Path, num_tokens: int, gap_ms: float) -> tuple[int, Any]:
    """A stand-in server on a free port: another process may take the port between
    `free_port`'s check and the stand-in's bind (CI saw it once), so a failed start tries the
    next port, three times at most."""
    for attempt in range(3):
        port = free_port()
        try:
            log = tmp_path / f"standin-{port}.log"
            return port, cost.start_standin(port, num_tokens, gap_ms, log)
        except ProcessFailed:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_each_client_process_gets_a_server_replica_in_turn() -> None:
    target = lg.Target("http://a/v1", "m")
    assert lg.shard_urls(target, [], 3) == ["http://a/v1"] * 3
    assert lg.shard_urls(target, ["http://b/v1"], 3) == [
        "http://a/v1",
        "http://b/v1",
        "http://a/v1",
    ]
    with pytest.raises(ValueError, match="at least as many client processes"):
        lg.shard_urls(target, ["http://b/v1", "http://c/v1"], 2)
