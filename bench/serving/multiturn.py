"""A multi-turn chat client for any OpenAI-compatible endpoint: the workload where KV tiers pay.

N sessions of T turns. A session's turn t sends the whole conversation so far: every earlier
user message and answer, then a new user message (random load-generator words from the
session's own seeded stream, `--first-tokens` words for the first message, `--user-tokens`
after), as chat completions with streaming. Between a session's turns it waits a think time
(exponential, mean `--think-s`, seeded). Sessions start at a fixed rate (a Poisson open loop of
session starts, `rate`) or in a fixed number of slots (`concurrency`: each slot runs its next
session when its previous one ended). A turn that fails ends its session.

Each turn is one request timed by loadgen (`stream_into`: TTFT to the first chunk with text, the
gaps between text chunks, `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`
where the server reports it: kvrail's router always does, vLLM with
`--enable-prompt-tokens-details`). The summary is loadgen's (`summarize`) under two goodput
rules, the sweep's (TTFT <= 2 s and the request's own ITL p99 <= 50 ms) and vLLM's
(`vllm bench serve --goodput ttft:2000 tpot:50`: TTFT and TPOT), plus what tiers change:
- `prompt_tokens_computed`: prompt tokens the server prefilled, summed over the turns (prompt
  tokens minus cached; None where the server reports no cached tokens);
- `cached_fraction_by_turn`: cached over prompt tokens, per turn index (turn 0 has nothing to
  reuse; later turns can reuse their whole previous prompt and answer);
- `live_prefix_ratio`: the sessions' final prompts (their last turn's prompt tokens), summed,
  over the GPU KV pool's tokens (`pool_tokens`): above 1, the pool cannot hold every session's
  prefix, and a session that comes back after its think time finds it only in a lower tier.

The pure parts (messages, think times, start times, the planned sizes, the summary) are tested
in tests/unit/bench/test_multiturn.py; `run_point` is the I/O.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam

from kvrail.testing.scripts import load_script

lg = load_script("kvrail_bench_loadgen", Path(__file__).resolve().parent.parent / "loadgen" /
                 "__init__.py")  # fmt: skip

SLO_ITL = lg.Slo(ttft_s=2.0, itl_s=0.05, itl_stat="p99")
"""The sweep's goodput rule (bench/sweep/run.py's defaults)."""
SLO_TPOT = lg.Slo(ttft_s=2.0, tpot_s=0.05)
"""vLLM's (`--goodput ttft:2000 tpot:50`, as bench/serving's vLLM runs use it)."""


@dataclass(frozen=True, slots=True)
class MultiTurn:
    sessions: int
    turns: int
    first_tokens: Any  # lg.Lengths: words of a session's first user message
    user_tokens: Any  # lg.Lengths: words of each later user message
    output_tokens: int
    """max_tokens of every turn (with `ignore_eos`, every answer's length)."""
    think_s: float
    """Mean think time between a session's turns (exponential); 0: none."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.output_tokens < 1:
            raise ValueError("sessions, turns and output_tokens must be >= 1")
        if self.think_s < 0:
            raise ValueError(f"think_s must be >= 0, got {self.think_s}")


@dataclass(slots=True)
class Turn:
    session: int
    turn: int
    result: Any  # lg.RequestResult


def user_message(plan: MultiTurn, session: int, turn: int) -> str:
    """Session `session`'s user message of turn `turn`: its own seeded words, the same whatever
    the other sessions, the load or the server."""
    rng = random.Random(f"{plan.seed}:session:{session}:turn:{turn}")
    lengths = plan.first_tokens if turn == 0 else plan.user_tokens
    return str(lg.words(lengths.sample(rng), rng))


def think_time(plan: MultiTurn, session: int, turn: int) -> float:
    """The wait before turn `turn` (> 0) of `session`: exponential with mean `think_s`."""
    if plan.think_s == 0 or turn == 0:
        return 0.0
    return random.Random(f"{plan.seed}:think:{session}:{turn}").expovariate(1.0 / plan.think_s)


def session_starts(plan: MultiTurn, rate: float) -> list[float]:
    """When each session starts, seconds from the point's start: loadgen's Poisson schedule."""
    return list(lg.arrival_times("poisson", rate, plan.seed, num_requests=plan.sessions))


def planned_final_prompt_words(plan: MultiTurn, template_tokens_per_message: int = 2) -> int:
    """About the tokens of every session's last prompt, summed, before anything runs: its user
    messages' words, the earlier answers and a few template tokens per message (one word of the
    load generator's list is one token of the usual tokenizers; the synthetic one's role
    markers are one token each)."""
    total = 0
    for session in range(plan.sessions):
        words = sum(len(user_message(plan, session, t).split()) for t in range(plan.turns))
        messages = 2 * plan.turns - 1
        total += words + (plan.turns - 1) * plan.output_tokens
        total += messages * template_tokens_per_message + 1
    return total


# -- the summary (pure) ---------------------------------------------------------------------------


def final_prompt_tokens(turns: Sequence[Turn]) -> dict[int, int]:
    """Per session, the prompt tokens of its last turn that the server counted."""
    last: dict[int, tuple[int, int]] = {}
    for t in turns:
        tokens = t.result.prompt_tokens
        if tokens is not None and (t.session not in last or t.turn > last[t.session][0]):
            last[t.session] = (t.turn, tokens)
    return {s: tokens for s, (_, tokens) in last.items()}


def summarize(turns: Sequence[Turn], pool_tokens: int) -> dict[str, Any]:
    """loadgen's summary of every turn (goodput under `SLO_ITL`), vLLM's goodput rule, the
    per-request ITL p99s, the prompt tokens computed, cached fractions by turn and the live
    prefixes' ratio to the pool."""
    if pool_tokens < 1:
        raise ValueError(f"pool_tokens must be >= 1, got {pool_tokens}")
    results = [t.result for t in turns]
    summary: dict[str, Any] = lg.summarize(results, SLO_ITL)
    summary["goodput_tpot"] = lg.summarize(results, SLO_TPOT)["goodput"]
    done = [t for t in turns if t.result.error is None]
    itl_p99s = [i for t in done if (i := lg.request_itl_s(t.result, "p99")) is not None]
    summary["request_itl_p99_s"] = lg.distribution(itl_p99s)
    reported = [t.result for t in done if t.result.prompt_tokens is not None]
    with_cached = [r for r in reported if r.cached_tokens is not None]
    summary["prompt_tokens_total"] = sum(r.prompt_tokens for r in reported)
    summary["prompt_tokens_computed"] = (
        sum(r.prompt_tokens - r.cached_tokens for r in with_cached)
        if reported and len(with_cached) == len(reported) else None
    )  # fmt: skip
    by_turn: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for t in done:
        r = t.result
        if r.prompt_tokens and r.cached_tokens is not None:
            by_turn[t.turn][0] += r.cached_tokens
            by_turn[t.turn][1] += r.prompt_tokens
    summary["cached_fraction_by_turn"] = {
        turn: cached / prompt for turn, (cached, prompt) in sorted(by_turn.items())
    }
    finals = final_prompt_tokens(turns)
    summary["sessions"] = len({t.session for t in turns})
    summary["sessions_completed"] = len({t.session for t in done if t.turn == max_turn(turns)})
    summary["final_prompt_tokens_total"] = sum(finals.values())
    summary["pool_tokens"] = pool_tokens
    summary["live_prefix_ratio"] = sum(finals.values()) / pool_tokens
    return summary


def max_turn(turns: Sequence[Turn]) -> int:
    return max((t.turn for t in turns), default=0)


def line(label: str, s: dict[str, Any]) -> str:
    """One line of a point's summary, for the log."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:.0f}"

    computed = s["prompt_tokens_computed"]
    return (
        f"{label}: {s['num_completed']}/{s['num_requests']} turns, TTFT p50/p99 "
        f"{ms(s['ttft_s']['p50'])}/{ms(s['ttft_s']['p99'])} ms, request ITL p99 p50/p99 "
        f"{ms(s['request_itl_p99_s']['p50'])}/{ms(s['request_itl_p99_s']['p99'])} ms, goodput "
        f"{s['goodput']['num_good']} (ITL rule) {s['goodput_tpot']['num_good']} (TPOT rule), "
        f"prompt tokens {s['prompt_tokens_total']} computed "
        f"{'-' if computed is None else computed}, live prefixes "
        f"{s['live_prefix_ratio']:.1f}x the pool, errors {s['errors'] or 0}"
    )


# -- the client (I/O) -----------------------------------------------------------------------------


async def run_session(
    client: openai.AsyncOpenAI, target: Any, plan: MultiTurn, session: int, point_start: float,
    out: list[Turn],
) -> None:  # fmt: skip
    """Send `session`'s turns in order, each after its think time, each prompt the whole
    conversation so far; a failed turn ends the session."""
    messages: list[ChatCompletionMessageParam] = []
    for turn in range(plan.turns):
        await asyncio.sleep(think_time(plan, session, turn))
        messages.append({"role": "user", "content": user_message(plan, session, turn)})
        approx = sum(len(str(m.get("content", "")).split()) for m in messages)
        result = lg.RequestResult(session * plan.turns + turn, False, 0.0, 0.0,
                                  approx_prompt_tokens=approx)  # fmt: skip
        text = await lg.stream_into(client, target, result, point_start, plan.output_tokens,
                                    messages=list(messages))  # fmt: skip
        out.append(Turn(session, turn, result))
        if result.error is not None:
            return
        messages.append({"role": "assistant", "content": text})


async def run_point(
    target: Any, plan: MultiTurn, *, rate: float | None = None, concurrency: int | None = None
) -> list[Turn]:
    """Every session of `plan`, started at `rate` sessions/s or in `concurrency` slots (exactly
    one of them); every turn, in the order they ended."""
    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of rate and concurrency")
    out: list[Turn] = []
    client = openai.AsyncOpenAI(base_url=target.url, api_key=target.api_key,
                                timeout=target.timeout_s, max_retries=0)  # fmt: skip
    start = time.perf_counter()
    try:
        if rate is not None:
            tasks = []
            for session, at in enumerate(session_starts(plan, rate)):
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                tasks.append(asyncio.create_task(run_session(client, target, plan, session,
                                                             start, out)))  # fmt: skip
            await asyncio.gather(*tasks)
        else:
            assert concurrency is not None
            queue = iter(range(plan.sessions))

            async def slot() -> None:
                for session in queue:
                    await run_session(client, target, plan, session, start, out)

            await asyncio.gather(*(slot() for _ in range(concurrency)))
    finally:
        await client.close()
    return out


def turn_records(turns: Sequence[Turn]) -> list[dict[str, Any]]:
    """Every turn for the JSON: its session and index, and loadgen's record of the request."""
    return [{"session": t.session, "turn": t.turn, **lg.request_record(t.result)} for t in turns]
