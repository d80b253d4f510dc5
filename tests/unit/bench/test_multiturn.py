"""bench/serving/multiturn.py and tiers.py: the multi-turn sessions, their summary, and one
session streamed from a stand-in OpenAI endpoint (each turn's prompt holds the earlier answers)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvrail.testing.scripts import load_script

BENCH = Path(__file__).resolve().parents[3] / "bench"
mt: Any = load_script("kvrail_bench_serving_multiturn", BENCH / "serving" / "multiturn.py")
tiers: Any = load_script("kvrail_bench_serving_tiers", BENCH / "serving" / "tiers.py")
lg = mt.lg


def plan(**kw: Any) -> Any:
    base = {
        "sessions": 3,
        "turns": 3,
        "first_tokens": lg.Lengths(50, 50),
        "user_tokens": lg.Lengths(5, 9),
        "output_tokens": 4,
        "think_s": 2.0,
        "seed": 7,
    }
    return mt.MultiTurn(**{**base, **kw})  # fmt: skip


def test_messages_are_seeded_per_session_and_turn() -> None:
    p = plan()
    assert mt.user_message(p, 1, 2) == mt.user_message(plan(sessions=10), 1, 2)
    assert len(mt.user_message(p, 0, 0).split()) == 50
    assert 5 <= len(mt.user_message(p, 0, 1).split()) <= 9
    assert mt.user_message(p, 0, 1) != mt.user_message(p, 1, 1)
    assert mt.user_message(p, 0, 1) != mt.user_message(plan(seed=8), 0, 1)


def test_think_times_are_exponential_with_the_mean_asked() -> None:
    p = plan(sessions=2000, think_s=3.0)
    assert mt.think_time(p, 0, 0) == 0.0
    times = [mt.think_time(p, s, 1) for s in range(2000)]
    assert min(times) > 0
    assert abs(sum(times) / len(times) - 3.0) < 0.3
    assert mt.think_time(plan(think_s=0.0), 0, 1) == 0.0
    with pytest.raises(ValueError, match="think_s"):
        plan(think_s=-1.0)


def test_sessions_start_at_the_rate() -> None:
    starts = mt.session_starts(plan(sessions=400), 4.0)
    assert len(starts) == 400 and starts[0] == 0.0 and starts == sorted(starts)
    assert abs(399 / starts[-1] - 4.0) < 0.6


def test_planned_final_prompts_count_every_message_and_answer() -> None:
    p = plan(sessions=1, turns=2, user_tokens=lg.Lengths(5, 5))
    # 50 + 5 user words, one 4-token answer, 3 messages of 2 template tokens, the generation mark
    assert mt.planned_final_prompt_words(p) == 50 + 5 + 4 + 3 * 2 + 1


def turn(session: int, index: int, *, prompt: int | None, cached: int | None,
         chunks: list[float], error: str | None = None) -> Any:  # fmt: skip
    r = lg.RequestResult(session * 10 + index, False, float(index), float(index) + chunks[-1],
                         list(chunks), len(chunks), prompt, cached)  # fmt: skip
    r.finish_reason = None if error else "length"
    r.error = error
    return mt.Turn(session, index, r)


def test_summary_counts_computed_tokens_cached_fractions_and_the_pool_ratio() -> None:
    ok = [0.1, 0.12, 0.14, 0.16]  # TTFT 100 ms, 20 ms gaps
    slow = [2.5, 2.52, 2.54]  # TTFT over 2 s
    gappy = [0.1, 0.2, 0.3]  # 100 ms gaps: ITL and TPOT over 50 ms
    turns = [
        turn(0, 0, prompt=100, cached=0, chunks=ok), turn(0, 1, prompt=200, cached=96, chunks=ok),
        turn(1, 0, prompt=120, cached=16, chunks=slow),
        turn(1, 1, prompt=240, cached=112, chunks=gappy),
        turn(2, 0, prompt=None, cached=None, chunks=[0.1], error="APIError(500)"),
    ]  # fmt: skip
    s = mt.summarize(turns, pool_tokens=110)
    assert s["num_requests"] == 5 and s["num_completed"] == 4
    assert s["goodput"]["num_good"] == 2 and s["goodput_tpot"]["num_good"] == 2
    assert s["prompt_tokens_total"] == 660
    assert s["prompt_tokens_computed"] == 660 - 224
    assert s["cached_fraction_by_turn"] == {0: 16 / 220, 1: 208 / 440}
    assert s["final_prompt_tokens_total"] == 440  # sessions 0 and 1's turn 1; 2 has none
    assert s["live_prefix_ratio"] == 4.0
    assert s["sessions"] == 3 and s["sessions_completed"] == 2
    assert s["request_itl_p99_s"]["count"] == 4
    assert "ITL rule" in mt.line("x", s)
    with pytest.raises(ValueError, match="pool_tokens"):
        mt.summarize(turns, 0)


def test_computed_tokens_are_unknown_where_the_server_reports_no_cached_tokens() -> None:
    s = mt.summarize([turn(0, 0, prompt=100, cached=None, chunks=[0.1, 0.2])], 16)
    assert s["prompt_tokens_computed"] is None and s["cached_fraction_by_turn"] == {}


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def test_a_session_sends_the_conversation_so_far_and_reads_cached_tokens() -> None:
    """A stand-in endpoint answers each turn with the turn's own words and reports half the
    prompt as cached; the next turn's messages must carry that answer."""
    seen: list[list[dict[str, str]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True
        seen.append(body["messages"])
        n = len(seen)
        base = {"id": f"r{n}", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        words = [f" answer{n}", " more"]
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        parts = [
            _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        ]
        parts += [_sse({**base, "choices": [{"index": 0, "delta": {"content": w}}]})
                  for w in words]  # fmt: skip
        parts.append(_sse({**base, "choices": [{"index": 0, "delta": {},
                                                "finish_reason": "length"}]}))  # fmt: skip
        usage = {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2}}  # fmt: skip
        parts.append(_sse({**base, "choices": [], "usage": usage}) + b"data: [DONE]\n\n")
        return httpx.Response(200, content=b"".join(parts),
                              headers={"content-type": "text/event-stream"})  # fmt: skip

    async def go() -> list[Any]:
        client = openai.AsyncOpenAI(
            base_url="http://standin/v1", api_key="x", max_retries=0,
            http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        )  # fmt: skip
        target = lg.Target("http://standin/v1", "m", extra_body={"ignore_eos": True})
        out: list[Any] = []
        await mt.run_session(client, target, plan(think_s=0.0), 1, 0.0, out)
        await client.close()
        return out

    turns = asyncio.run(go())
    p = plan()
    assert [m["role"] for m in seen[2]] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in seen[2][::2]] == [mt.user_message(p, 1, t) for t in range(3)]
    assert [m["content"] for m in seen[2][1::2]] == [" answer1 more", " answer2 more"]
    assert [(t.session, t.turn) for t in turns] == [(1, 0), (1, 1), (1, 2)]
    last = turns[-1].result
    assert last.error is None and len(last.chunk_times_s) == 2
    assert last.prompt_tokens == sum(len(m["content"].split()) for m in seen[2])
    assert last.cached_tokens == last.prompt_tokens // 2
    records = mt.turn_records(turns)
    assert records[1]["session"] == 1 and records[1]["turn"] == 1


def test_tiers_reads_the_kv_metrics_and_sizes_the_pool() -> None:
    page = "\n".join([
        "# HELP kvrail_kv_tier_bytes bytes", 'kvrail_kv_tier_bytes{tier="host"} 4096.0',
        'kvrail_kv_tier_load_seconds_bucket{tier="host",le="0.1"} 3.0',
        'kvrail_kv_tier_load_seconds_count{tier="host"} 3.0',
        'kvrail_kv_tier_loads_created{tier="host"} 1796556328.9',
        "kvrail_kv_cache_utilization_ratio 0.5", "kvrail_running_requests 2.0",
    ])  # fmt: skip
    assert tiers.kv_metrics(page) == {
        'kvrail_kv_tier_bytes{tier="host"}': 4096.0,
        'kvrail_kv_tier_load_seconds_count{tier="host"}': 3.0,
        "kvrail_kv_cache_utilization_ratio": 0.5,
    }
    assert tiers.pool_tokens(32) == 31 * 16


def test_tiers_gives_both_kvrail_setups_and_vllm_the_same_kv_budget() -> None:
    args = tiers.parse_args(["--shape", "tiny", "--setups", "kvrail,kvrail-host,vllm",
                             "--kv-blocks", "100", "--host-tier-gib", "1.5"])  # fmt: skip
    args.model_dir = Path("/m")
    plain, host = (tiers.worker_env(args, s, 9000) for s in ("kvrail", "kvrail-host"))
    assert plain["KVRAIL_NUM_KV_BLOCKS"] == host["KVRAIL_NUM_KV_BLOCKS"] == "100"
    assert plain["KVRAIL_KV_HOST_TIER_BYTES"] == "0"
    assert host["KVRAIL_KV_HOST_TIER_BYTES"] == str(3 << 29)
    argv = tiers.vllm_argv(args, 8100)
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "100"
    assert argv[argv.index("--kv-offloading-size") + 1] == "1.5"
    assert argv[argv.index("--kv-offloading-backend") + 1] == "native"
    assert "--enable-prompt-tokens-details" in argv
    smoke = tiers.parse_args(["--cpu-smoke"])
    assert smoke.device == "cpu" and smoke.setups == ["kvrail", "kvrail-host"]
    assert smoke.kv_blocks == 32 and smoke.sessions == 8 and smoke.concurrency == [8]
    small = tiers.parse_args(["--cpu-smoke", "--sessions", "2", "--concurrency", "2"])
    assert (small.sessions, small.concurrency, small.kv_blocks) == (2, [2], 32)
    with pytest.raises(SystemExit):
        tiers.parse_args(["--setups", "vllm"])  # no --shape: no model directory for vLLM
