"""A load generator for any OpenAI-compatible endpoint (kvrail's router, vLLM, SGLang, ...).

    .venv/bin/python -P bench/loadgen.py --url http://127.0.0.1:8000/v1 \\
        --model SmolLM2-135M-Instruct --rates 0.5,1,2 --num-requests 40 --warmup 4 \\
        --prompt-tokens 64-256 --output-tokens 32 --slo-ttft-s 2 --slo-itl-s 0.2 \\
        --out results.json --plot results

Every request streams through the real `openai.AsyncOpenAI` client (`stream=True`,
`stream_options={"include_usage": True}`), so each chunk's arrival time is seen.

Load. `--rates R1,R2,...` is an open loop: requests arrive at R per second, `--arrival poisson`
(exponential gaps, the default) or `constant` (every 1/R s), whether or not earlier ones finished;
`inf` sends them all at once. `--client-processes N` shares an open loop's schedule out over N
processes (one Python process of the openai client spends about 0.3 ms of CPU per chunk on a
2-vCPU VM: a few thousand chunks/s and it, not the server, sets the gaps; see `_run_sharded`).
Each point records how busy its busiest client process was (`client`), and calls the point
client-bound above 80% of a core. `--concurrency C1,C2,...` is a closed loop: C clients, each
sending its next request when its previous one ended. Each load point runs `--num-requests`
measured requests or `--duration-s` seconds of arrivals, after `--warmup` requests that are sent
the same way but left out of every statistic.

Workload. Prompts are random words from a fixed list (`WORDS`), so no tokenizer is needed: one
word is about one token (the real counts come back in `usage` and are reported). Lengths are `N`
(fixed) or `A-B` (uniform integers, inclusive). `--long-context-fraction F` makes a fraction F of
the requests long-context ones, with prompt lengths from `--long-context-tokens`.
`--shared-prefixes N --prefix-tokens T` puts one of N distinct system prompts of T words in front
of each request (chosen at random), the workload where prefix caching and KV-aware routing
matter; the user part stays unique per request. Request i is built from its own seeded random
stream, so the same `--seed` gives the same requests in the same order on every run.

Definitions (all times from `time.perf_counter()` in this process):
- TTFT: from sending the request to the first chunk that carries text (chat: non-empty
  `delta.content`; completions: non-empty `text`). A chat stream's role-only first chunk does not
  count: a server may send it before any prefill.
- ITL: every gap between two consecutive text-carrying chunks, the gaps of all measured requests
  pooled. A chunk carrying several tokens is one gap (servers that batch tokens show fewer,
  longer gaps; TPOT is per token).
- TPOT: per request, (e2e - TTFT) / (output_tokens - 1), output_tokens from `usage`; requests with
  fewer than 2 output tokens have none.
- e2e: from sending the request to the end of its stream.
- A request is an error when the client raised (the type, with the HTTP status where there is
  one, e.g. `RateLimitError(429)`), when the stream ended without a finish reason
  (`IncompleteStream`) or without any text (`EmptyOutput`).
- SLOs: `--slo-ttft-s` bounds a request's TTFT; `--slo-itl-s` bounds its own ITL statistic,
  `--slo-itl-stat p99` (default: the 99th percentile of its gaps, linear interpolation) or `max`
  (its longest gap); a request with fewer than two text chunks has no gap and meets it;
  `--slo-tpot-s` bounds its TPOT. Goodput is the number of measured requests that completed and
  met every SLO given, per second of the window. Attainment is that number over all measured
  requests (errors included).
- Window: from the first measured request's send to the last measured request's end. Requests/s
  and output tokens/s count completed measured requests over the window. The arrival rate is
  the one the measured requests really had ((n - 1) / span of their send times): a Poisson
  sample of a few dozen arrivals can stray from the nominal rate by 20% or more.

Output: a table per load point on stdout, a progress line on stderr, `--out` (JSON: the
configuration, the machine, per point its summary and every request), `--plot PREFIX`
(`PREFIX-latency.png`: TTFT/ITL/TPOT percentiles per load point; `PREFIX-goodput.png`).

The pure parts (lengths, arrival schedules, prompts, statistics, SLOs) are separate from the I/O
and tested in tests/unit/bench/test_loadgen.py.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

Arrival = Literal["poisson", "constant", "closed"]
Endpoint = Literal["chat", "completions"]
ItlStat = Literal["p99", "max"]

# Common English nouns, each one token (with its leading space) in the BPE vocabularies of the
# usual open models, so "N words" is about N tokens.
_WORD_TEXT = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea
kid body information back parent face level office door health person art war history
party result change morning reason research girl guy moment air teacher force education
foot boy age policy process music market sense nation plan college interest death
experience effect use class control care field development role effort rate heart drug
show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position
player record paper space ground form event official matter center couple site project
activity star table need court oil situation cost industry figure street image phone data
picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair
window evidence population truth rock"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))


# -- workload (pure) -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lengths:
    """A length distribution in tokens: fixed (`low == high`) or uniform over [low, high]."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"lengths need 1 <= low <= high, got {self.low}-{self.high}")

    @classmethod
    def parse(cls, spec: str) -> Lengths:
        """`N` (fixed) or `A-B` (uniform integers, inclusive)."""
        low, sep, high = spec.strip().partition("-")
        try:
            return cls(int(low), int(high) if sep else int(low))
        except ValueError as err:
            raise ValueError(f"length {spec!r}: expected N or A-B with 1 <= A <= B") from err

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_tokens: Lengths = Lengths(128, 128)
    output_tokens: Lengths = Lengths(64, 64)
    num_prefixes: int = 0
    """Distinct shared system prompts; 0: none."""
    prefix_tokens: int = 0
    long_context_fraction: float = 0.0
    long_context_tokens: Lengths | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prefixes < 0 or self.prefix_tokens < 0:
            raise ValueError("num_prefixes and prefix_tokens must be >= 0")
        if (self.num_prefixes > 0) != (self.prefix_tokens > 0):
            raise ValueError("shared prefixes need both a count and a length")
        if not 0.0 <= self.long_context_fraction <= 1.0:
            raise ValueError("long_context_fraction must be in [0, 1]")
        if self.long_context_fraction > 0 and self.long_context_tokens is None:
            raise ValueError("a long-context fraction needs long_context_tokens")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    is_warmup: bool
    system: str | None
    user: str
    max_tokens: int
    prefix_id: int | None
    is_long: bool

    @property
    def approx_prompt_tokens(self) -> int:
        """Words in the prompt (about its tokens, before any chat template)."""
        return len(self.user.split()) + (len(self.system.split()) if self.system else 0)


def words(num_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def system_prompts(workload: Workload) -> tuple[str, ...]:
    """The workload's shared prefixes: each from its own seeded stream, so prefix k is the same
    whatever the number of prefixes."""
    return tuple(
        words(workload.prefix_tokens, random.Random(f"{workload.seed}:prefix:{k}"))
        for k in range(workload.num_prefixes)
    )


def make_request(
    workload: Workload, prefixes: Sequence[str], index: int, is_warmup: bool
) -> RequestSpec:
    """Request `index` of the workload, from its own seeded stream (independent of the others)."""
    rng = random.Random(f"{workload.seed}:request:{index}")
    is_long = rng.random() < workload.long_context_fraction
    lengths = workload.long_context_tokens if is_long else workload.prompt_tokens
    assert lengths is not None  # Workload checks it
    prefix_id = rng.randrange(len(prefixes)) if prefixes else None
    return RequestSpec(
        index=index,
        is_warmup=is_warmup,
        system=prefixes[prefix_id] if prefix_id is not None else None,
        user=words(lengths.sample(rng), rng),
        max_tokens=workload.output_tokens.sample(rng),
        prefix_id=prefix_id,
        is_long=is_long,
    )


def _gaps(process: Arrival, rate: float, rng: random.Random) -> Iterator[float]:
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
    while True:
        yield rng.expovariate(rate) if process == "poisson" else 1.0 / rate


def arrival_times(
    process: Arrival,
    rate: float,
    seed: int,
    *,
    num_warmup: int = 0,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> list[float]:
    """Send times (seconds from the start) of an open loop: `num_warmup` warm-up arrivals, then
    `num_requests` measured ones or as many as arrive within `duration_s` of the first measured
    one. The first arrival is at 0. Exactly one of `num_requests` and `duration_s` is given."""
    if process not in ("poisson", "constant"):
        raise ValueError(f"not an open-loop arrival process: {process!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests and duration_s")
    if duration_s is not None and (math.isinf(rate) or duration_s <= 0):
        raise ValueError("a duration needs a finite rate and a positive duration")
    if num_warmup < 0 or (num_requests is not None and num_requests < 1):
        raise ValueError("num_warmup must be >= 0 and num_requests >= 1")
    gaps = _gaps(process, rate, random.Random(f"{seed}:arrivals"))
    times = [0.0]
    while len(times) < num_warmup + (num_requests or 1):
        times.append(times[-1] + next(gaps))
    if duration_s is not None:
        end = times[num_warmup] + duration_s
        while (t := times[-1] + next(gaps)) < end:
            times.append(t)
    return times


# -- results and statistics (pure) ----------------------------------------------------------------


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds."""

    index: int
    is_warmup: bool
    start_s: float
    """Send time since the load point began."""
    end_s: float
    """End of the stream (or the error) since the load point began."""
    chunk_times_s: list[float] = field(default_factory=list)
    """Arrival of each text-carrying chunk, since the send."""
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    approx_prompt_tokens: int = 0
    prefix_id: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    response_id: str | None = None
    """The server's id of the response (the chunks' `id`), to find the request in its logs."""

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def gaps_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot_s(self) -> float | None:
        ttft = self.ttft_s
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None = None
    itl_s: float | None = None
    itl_stat: ItlStat = "p99"
    tpot_s: float | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between order statistics (numpy's
    default method); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} not in [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else None,
        "count": len(values),
    }


def request_itl_s(result: RequestResult, stat: ItlStat) -> float | None:
    """The request's own ITL statistic: p99 or max of its gaps; None without gaps."""
    gaps = result.gaps_s
    if not gaps:
        return None
    return max(gaps) if stat == "max" else percentile(gaps, 99)


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """Completed, and within every bound `slo` gives (a request without gaps meets the ITL one,
    one without a TPOT meets the TPOT one)."""
    if result.error is not None or result.ttft_s is None:
        return False
    if slo.ttft_s is not None and result.ttft_s > slo.ttft_s:
        return False
    itl = request_itl_s(result, slo.itl_stat)
    if slo.itl_s is not None and itl is not None and itl > slo.itl_s:
        return False
    tpot = result.tpot_s
    return not (slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s)


def summarize(results: Sequence[RequestResult], slo: Slo) -> dict[str, Any]:
    """Statistics of the measured (non-warm-up) requests; see the module docstring."""
    measured = [r for r in results if not r.is_warmup]
    done = [r for r in measured if r.error is None]
    window_s = (
        max(r.end_s for r in measured) - min(r.start_s for r in measured) if measured else 0.0
    )

    def per_s(n: float) -> float | None:
        return n / window_s if window_s > 0 else None

    starts = sorted(r.start_s for r in measured)
    arrival_span_s = starts[-1] - starts[0] if starts else 0.0
    num_good = sum(meets_slo(r, slo) for r in measured)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    prompt = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {
        "num_requests": len(measured),
        "num_warmup": len(results) - len(measured),
        "num_completed": len(done),
        "num_errors": len(measured) - len(done),
        "errors": dict(sorted(Counter(r.error for r in measured if r.error).items())),
        "window_s": window_s,
        # What the schedule really offered: a Poisson sample of n arrivals strays from its rate.
        "arrival_rate_per_s": (len(starts) - 1) / arrival_span_s if arrival_span_s > 0 else None,
        "requests_per_s": per_s(len(done)),
        "output_tokens_per_s": per_s(sum(r.output_tokens for r in done)),
        "ttft_s": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_s": distribution([g for r in done for g in r.gaps_s]),
        "tpot_s": distribution([t for r in done if (t := r.tpot_s) is not None]),
        "e2e_s": distribution([r.e2e_s for r in done]),
        "output_tokens": distribution([float(r.output_tokens) for r in done]),
        "prompt_tokens": distribution([float(p) for p in prompt]),
        "approx_prompt_tokens": distribution([float(r.approx_prompt_tokens) for r in done]),
        "cached_prompt_tokens_total": sum(cached) if cached else None,
        "goodput": {
            "slo": asdict(slo),
            "num_good": num_good,
            "requests_per_s": per_s(num_good),
            "attainment": num_good / len(measured) if measured else None,
        },
    }


# -- I/O: requests, load loops, progress ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    model: str
    api_key: str = "EMPTY"
    endpoint: Endpoint = "chat"
    temperature: float = 0.0
    timeout_s: float = 600.0
    extra_body: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class LoadPoint:
    arrival: Arrival
    rate: float | None = None
    concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    num_warmup: int = 0

    @property
    def label(self) -> str:
        if self.arrival == "closed":
            return f"concurrency {self.concurrency}"
        return f"{self.arrival} {self.rate:g}/s"


@dataclass(slots=True)
class Progress:
    label: str
    total: int | None
    num_sent: int = 0
    num_done: int = 0
    num_errors: int = 0
    started: float = field(default_factory=time.perf_counter)

    def line(self) -> str:
        total = f"/{self.total}" if self.total is not None else ""
        return (
            f"[{self.label}] sent {self.num_sent}{total}  done {self.num_done}  "
            f"errors {self.num_errors}  in flight {self.num_sent - self.num_done}  "
            f"{time.perf_counter() - self.started:.0f}s"
        )


async def _show(progress: Progress) -> None:
    tty = sys.stderr.isatty()
    while True:
        if tty:
            print("\r" + progress.line(), end="", file=sys.stderr, flush=True)
            await asyncio.sleep(0.5)
        else:
            await asyncio.sleep(10)
            print(progress.line(), file=sys.stderr, flush=True)


def _error_name(err: BaseException) -> str:
    status = getattr(err, "status_code", None)
    return f"{type(err).__name__}({status})" if status is not None else type(err).__name__


def _chunk_text(chunk: ChatCompletionChunk | Completion) -> tuple[str, str | None]:
    """The text a streamed chunk carries, and its finish reason."""
    if isinstance(chunk, ChatCompletionChunk):
        texts = [c.delta.content or "" for c in chunk.choices]
    else:
        texts = [c.text for c in chunk.choices]
    finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), None)
    return "".join(texts), finish


async def send_request(
    client: openai.AsyncOpenAI, target: Target, spec: RequestSpec, point_start: float
) -> RequestResult:
    """Send one streamed request and time every chunk."""
    start = time.perf_counter()
    result = RequestResult(
        spec.index, spec.is_warmup, start - point_start, start - point_start,
        approx_prompt_tokens=spec.approx_prompt_tokens, prefix_id=spec.prefix_id,
    )  # fmt: skip
    options: dict[str, Any] = {
        "model": target.model, "max_tokens": spec.max_tokens, "temperature": target.temperature,
        "stream_options": {"include_usage": True}, "extra_body": target.extra_body,
    }  # fmt: skip
    stream: openai.AsyncStream[ChatCompletionChunk] | openai.AsyncStream[Completion]
    try:
        if target.endpoint == "chat":
            messages: list[ChatCompletionMessageParam] = []
            if spec.system:
                messages.append({"role": "system", "content": spec.system})
            messages.append({"role": "user", "content": spec.user})
            stream = await client.chat.completions.create(messages=messages, stream=True, **options)
        else:
            prompt = f"{spec.system}\n\n{spec.user}" if spec.system else spec.user
            stream = await client.completions.create(prompt=prompt, stream=True, **options)
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                result.response_id = result.response_id or chunk.id
                text, finish_reason = _chunk_text(chunk)
                if text:
                    result.chunk_times_s.append(now - start)
                if finish_reason:
                    result.finish_reason = finish_reason
                if chunk.usage is not None:
                    result.output_tokens = chunk.usage.completion_tokens
                    result.prompt_tokens = chunk.usage.prompt_tokens
                    details = getattr(chunk.usage, "prompt_tokens_details", None)
                    result.cached_tokens = getattr(details, "cached_tokens", None)
        if result.finish_reason is None:
            result.error = "IncompleteStream"
        elif not result.chunk_times_s:
            result.error = "EmptyOutput"
        elif result.prompt_tokens is None:  # no usage: count text chunks instead
            result.output_tokens = len(result.chunk_times_s)
    except (openai.APIError, httpx.HTTPError, TimeoutError, OSError) as err:
        result.error = _error_name(err)
    result.end_s = time.perf_counter() - point_start
    return result


def in_shard(index: int, shard: int, num_shards: int) -> bool:
    """Whether request `index` of an open loop is sent by client process `shard` of
    `num_shards` (round robin, so every process sends every rate's share at the same times)."""
    return index % num_shards == shard


async def _open_loop(
    client: openai.AsyncOpenAI,
    target: Target,
    workload: Workload,
    point: LoadPoint,
    progress: Progress,
    shard: tuple[int, int] = (0, 1),
    start: float | None = None,
) -> list[RequestResult]:
    """The requests of `point`'s schedule in `shard` (this process's index, the number of
    processes), each sent at its time after `start` (a `perf_counter` value, which on Linux is
    the same clock in every process; default: now)."""
    assert point.rate is not None
    times = arrival_times(
        point.arrival, point.rate, workload.seed, num_warmup=point.num_warmup,
        num_requests=point.num_requests, duration_s=point.duration_s,
    )  # fmt: skip
    mine = [(i, at) for i, at in enumerate(times) if in_shard(i, *shard)]
    progress.total = len(mine)
    prefixes = system_prompts(workload)
    start = time.perf_counter() if start is None else start

    async def one(spec: RequestSpec) -> RequestResult:
        result = await send_request(client, target, spec, start)
        progress.num_done += 1
        progress.num_errors += result.error is not None
        return result

    tasks = []
    for index, at in mine:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        spec = make_request(workload, prefixes, index, index < point.num_warmup)
        tasks.append(asyncio.create_task(one(spec)))
        progress.num_sent += 1
    return list(await asyncio.gather(*tasks))


async def _closed_loop(
    client: openai.AsyncOpenAI,
    target: Target,
    workload: Workload,
    point: LoadPoint,
    progress: Progress,
) -> list[RequestResult]:
    assert point.concurrency is not None
    prefixes = system_prompts(workload)
    if point.num_requests is not None:
        progress.total = point.num_warmup + point.num_requests
    indices = itertools.count()
    start = time.perf_counter()
    measure_until: float | None = None  # set when the first measured request is sent
    results: list[RequestResult] = []

    async def client_loop() -> None:
        nonlocal measure_until
        while True:
            index = next(indices)
            is_warmup = index < point.num_warmup
            if point.num_requests is not None and index >= point.num_warmup + point.num_requests:
                return
            if point.duration_s is not None and not is_warmup:
                if measure_until is None:
                    measure_until = time.perf_counter() + point.duration_s
                elif time.perf_counter() >= measure_until:
                    return
            progress.num_sent += 1
            result = await send_request(
                client, target, make_request(workload, prefixes, index, is_warmup), start
            )
            results.append(result)
            progress.num_done += 1
            progress.num_errors += result.error is not None

    await asyncio.gather(*(client_loop() for _ in range(point.concurrency)))
    return sorted(results, key=lambda r: r.index)


async def run_point(
    target: Target, workload: Workload, point: LoadPoint, *, show_progress: bool = True,
    processes: int = 1,
) -> list[RequestResult]:  # fmt: skip
    """Run one load point against `target`; every request's result, warm-up ones included.
    With `processes` > 1 (an open loop only), that many client processes share the schedule
    (and show no progress line)."""
    results, _ = await run_point_measured(
        target, workload, point, show_progress=show_progress, processes=processes
    )
    return results


def shard_urls(target: Target, replicas: Sequence[str], processes: int) -> list[str]:
    """The URL each client process sends to: `target.url` and the other `replicas` of the same
    server (e.g. router processes on other ports) in turn, so that every replica gets a client
    process of its own. More replicas than processes would leave some idle: refused."""
    urls = [target.url, *replicas]
    if len(urls) > processes:
        raise ValueError(f"{len(urls)} server URLs need at least as many client processes, "
                         f"not {processes}")  # fmt: skip
    return [urls[k % len(urls)] for k in range(processes)]


async def run_point_measured(
    target: Target, workload: Workload, point: LoadPoint, *, show_progress: bool = True,
    processes: int = 1, replicas: Sequence[str] = (),
) -> tuple[list[RequestResult], float]:  # fmt: skip
    """`run_point`, and the busiest client process's CPU time over its wall time while it sent
    and read (near 1.0: the client, not the server, set the pace of the chunks it read).
    `replicas`: more URLs of the same server, shared out by `shard_urls`."""
    urls = shard_urls(target, replicas, processes)
    if processes > 1:
        return await _run_sharded(target, workload, point, urls)
    progress = Progress(point.label, None)
    shower = asyncio.create_task(_show(progress)) if show_progress else None
    client = openai.AsyncOpenAI(
        base_url=target.url, api_key=target.api_key, max_retries=0, timeout=target.timeout_s
    )
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        loop = _closed_loop if point.arrival == "closed" else _open_loop
        results = await loop(client, target, workload, point, progress)
        return results, (time.process_time() - cpu) / (time.perf_counter() - wall)
    finally:
        await client.close()
        if shower is not None:
            shower.cancel()
            print("\r" + progress.line(), file=sys.stderr, flush=True)


# -- several client processes ---------------------------------------------------------------------
#
# One Python process streaming through `openai.AsyncOpenAI` spends about 0.3 ms of CPU per chunk
# (2-vCPU development VM, bench/loadgen_cost.txt): at a few thousand chunks/s its core is full,
# chunks queue in its socket buffers and are read in bunches, and the server's ITL looks worse
# than it is. A sweep of 150 streams at 10 ms steps needs 15,000/s. `--client-processes N`
# splits an open loop's schedule round robin over N child processes (`python -P loadgen.py
# --shard`), which wait for one start time and send their requests at the same instants as one
# process would.


_THIS_FILE = str(Path(__file__).resolve())
CLIENT_BOUND = 0.8
"""A client process busier than this (CPU over wall time) reads its chunks late: a point's gaps
are then partly the client's. The report says so (`client.bound`)."""


def _workload_from(d: dict[str, Any]) -> Workload:
    lengths = {k: Lengths(**d[k]) if d[k] is not None else None
               for k in ("prompt_tokens", "output_tokens", "long_context_tokens")}  # fmt: skip
    return Workload(**{**d, **lengths})


async def _run_sharded(
    target: Target, workload: Workload, point: LoadPoint, urls: Sequence[str]
) -> tuple[list[RequestResult], float]:
    """Client process k sends its shard of the schedule to `urls[k]`."""
    if point.arrival == "closed":
        raise ValueError("several client processes need an open loop (a rate), not a concurrency")
    processes = len(urls)
    specs = [json.dumps({"target": {**asdict(target), "url": url}, "workload": asdict(workload),
                         "point": asdict(point), "processes": processes})
             for url in urls]  # fmt: skip
    pipe = asyncio.subprocess.PIPE
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-P", _THIS_FILE, "--shard", str(k), stdin=pipe, stdout=pipe
        )
        for k in range(processes)
    ]
    try:
        for child, spec in zip(children, specs, strict=True):
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(spec.encode() + b"\n")
            await child.stdin.drain()
        for child in children:  # each has imported openai and built its client
            assert child.stdout is not None
            if (await child.stdout.readline()).strip() != b"ready":
                code = await child.wait()
                raise RuntimeError(f"client process {child.pid} did not start (exit {code})")
        start = time.perf_counter() + 0.05
        for child in children:
            assert child.stdin is not None
            child.stdin.write(f"{start!r}\n".encode())
            await child.stdin.drain()
        # Not `communicate()`, which would close their stdin now: its end tells a client
        # process that this one is gone (`_end_at_eof`).
        outputs = await asyncio.gather(*(_output(child) for child in children))
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
            if child.stdin is not None:
                child.stdin.close()
    results: list[RequestResult] = []
    busiest = 0.0
    for child, out in zip(children, outputs, strict=True):
        if child.returncode != 0:
            raise RuntimeError(f"client process {child.pid} exited with {child.returncode}")
        report = json.loads(out)
        results += [RequestResult(**r) for r in report["results"]]
        busiest = max(busiest, report["busy"])
    return sorted(results, key=lambda r: r.index), busiest


async def _output(child: asyncio.subprocess.Process) -> bytes:
    """A client process's whole stdout, once it has exited."""
    assert child.stdout is not None
    out = await child.stdout.read()
    await child.wait()
    return out


def _end_at_eof() -> None:
    """A client process's stdin stays open while `_run_sharded` waits for it. Its end means the
    load generator that started this process is gone (killed, SIGKILL included), so this one
    ends too, whatever it still has in flight."""
    sys.stdin.read()
    os._exit(3)


async def _shard_main(shard: int) -> None:
    """A child of `_run_sharded`: the spec on stdin, "ready", the start time on stdin, then its
    requests' results and its CPU over wall time as one JSON object on stdout."""
    loop = asyncio.get_running_loop()
    spec = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    target, point = Target(**spec["target"]), LoadPoint(**spec["point"])
    workload = _workload_from(spec["workload"])
    client = openai.AsyncOpenAI(
        base_url=target.url, api_key=target.api_key, max_retries=0, timeout=target.timeout_s
    )
    print("ready", flush=True)
    start = float(await loop.run_in_executor(None, sys.stdin.readline))
    threading.Thread(target=_end_at_eof, name="end-at-eof", daemon=True).start()
    progress = Progress(point.label, None)
    cpu = time.process_time()
    try:
        results = await _open_loop(client, target, workload, point, progress,
                                   (shard, spec["processes"]), start)  # fmt: skip
        busy = (time.process_time() - cpu) / (time.perf_counter() - start)
    finally:
        await client.close()
    print(json.dumps({"results": [asdict(r) for r in results], "busy": busy}), flush=True)


def request_record(r: RequestResult) -> dict[str, Any]:
    """One request in the JSON output (its chunk times are summarised, not listed)."""
    itl = r.gaps_s
    return {
        "index": r.index, "is_warmup": r.is_warmup, "start_s": r.start_s, "ttft_s": r.ttft_s,
        "e2e_s": r.e2e_s, "tpot_s": r.tpot_s, "itl_max_s": max(itl) if itl else None,
        "num_chunks": len(r.chunk_times_s), "output_tokens": r.output_tokens,
        "prompt_tokens": r.prompt_tokens, "approx_prompt_tokens": r.approx_prompt_tokens,
        "cached_tokens": r.cached_tokens, "prefix_id": r.prefix_id,
        "finish_reason": r.finish_reason, "error": r.error, "response_id": r.response_id,
    }  # fmt: skip


def _json_number(value: Any) -> Any:
    """JSON has no infinity: an infinite rate is written as the string "inf"."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def machine() -> dict[str, Any]:
    """Where the load generator ran (the server may be elsewhere)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "hostname": platform.node(), "python": platform.python_version(),
        "nproc": len(os.sched_getaffinity(0)), "cpu_model": model,
        "loadavg": list(os.getloadavg()),
    }  # fmt: skip


# -- reporting -------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(points: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of the load points' summaries (latencies in ms)."""
    head = (
        f"{'load':>18} {'done':>5} {'err':>4} {'req/s':>6} {'tok/s':>7} {'good/s':>6} "
        f"{'TTFT p50/p90/p99':>18} {'ITL p50/p90/p99':>16} {'TPOT p50/p99':>13}"
    )
    lines = [head]
    for p in points:
        s = p["summary"]

        def trio(d: dict[str, Any], keys: Sequence[str]) -> str:
            return "/".join(_ms(d[k]) for k in keys)

        lines.append(
            f"{p['label']:>18} {s['num_completed']:>5} {s['num_errors']:>4} "
            f"{s['requests_per_s'] or 0:>6.2f} {s['output_tokens_per_s'] or 0:>7.1f} "
            f"{s['goodput']['requests_per_s'] or 0:>6.2f} "
            f"{trio(s['ttft_s'], ('p50', 'p90', 'p99')):>18} "
            f"{trio(s['itl_s'], ('p50', 'p90', 'p99')):>16} "
            f"{trio(s['tpot_s'], ('p50', 'p99')):>13}"
        )
    return "\n".join(lines)


def plot(points: Sequence[dict[str, Any]], prefix: str) -> list[Path]:
    """`prefix`-latency.png and `prefix`-goodput.png, one x position per load point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(points)))
    labels = [p["label"].replace(" ", "\n", 1) for p in points]
    out = [Path(f"{prefix}-latency.png"), Path(f"{prefix}-goodput.png")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric, title in zip(axes, ("ttft_s", "itl_s", "tpot_s"), ("TTFT", "ITL", "TPOT"),
                                 strict=True):  # fmt: skip
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [p["summary"][metric][q] for p in points]
            ax.plot(x, [math.nan if y is None else y * 1000 for y in ys], style, label=q)
        ax.set(title=title, ylabel="ms", xticks=x)
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out[0], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, style, name in (("requests_per_s", "s--", "completed"), (None, "o-", "goodput")):
        ys = [p["summary"][key] if key else p["summary"]["goodput"]["requests_per_s"]
              for p in points]  # fmt: skip
        ax.plot(x, [math.nan if y is None else y for y in ys], style, label=name)
    rates = [p["point"]["rate"] for p in points]
    if all(isinstance(r, int | float) for r in rates):
        ax.plot(x, rates, "k:", label="offered")
    slo = points[0]["summary"]["goodput"]["slo"] if points else {}
    given = ", ".join(f"{k}={v}" for k, v in slo.items() if v is not None and k != "itl_stat")
    if slo.get("itl_s") is not None:
        given += f" (ITL: each request's {slo['itl_stat']})"
    ax.set(title=f"goodput (SLO: {given or 'none'})", ylabel="requests/s", xticks=x)
    ax.set_xticklabels(labels, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out[1], dpi=120)
    plt.close(fig)
    return out


# -- command line ----------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="served model name (default: the first of GET /models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rates", type=_floats, help="open loop: requests/s, e.g. 0.5,1,2,inf")
    load.add_argument("--concurrency", type=_ints, help="closed loop: clients, e.g. 1,4,16")
    p.add_argument("--arrival", choices=("poisson", "constant"), default="poisson")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=int, help="measured requests per load point")
    size.add_argument("--duration-s", type=float, help="seconds of arrivals per load point")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per load point")
    p.add_argument("--prompt-tokens", type=Lengths.parse, default=Lengths(128, 128))
    p.add_argument("--output-tokens", type=Lengths.parse, default=Lengths(64, 64))
    p.add_argument("--shared-prefixes", type=int, default=0, help="distinct system prompts")
    p.add_argument("--prefix-tokens", type=int, default=0, help="words in each system prompt")
    p.add_argument("--long-context-fraction", type=float, default=0.0)
    p.add_argument("--long-context-tokens", type=Lengths.parse)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=json.loads, help="JSON, e.g. '{\"ignore_eos\": true}'")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-s", type=float)
    p.add_argument("--slo-itl-s", type=float)
    p.add_argument("--slo-itl-stat", choices=("p99", "max"), default="p99")
    p.add_argument("--slo-tpot-s", type=float)
    p.add_argument("--out", type=Path, help="JSON report")
    p.add_argument("--plot", help="PNG prefix: PREFIX-latency.png, PREFIX-goodput.png")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--client-processes", type=int, default=1,
                   help="client processes sharing each open-loop point")  # fmt: skip
    args = p.parse_args(argv)
    if args.num_requests is None and args.duration_s is None:
        args.num_requests = 20
    if args.rates is None and args.concurrency is None:
        args.rates = [1.0]
    return args


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    common = {"num_requests": args.num_requests, "duration_s": args.duration_s,
              "num_warmup": args.warmup}  # fmt: skip
    if args.concurrency is not None:
        return [LoadPoint("closed", concurrency=c, **common) for c in args.concurrency]
    return [LoadPoint(args.arrival, rate=r, **common) for r in args.rates]


async def _served_model(url: str, api_key: str) -> str:
    async with openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0) as client:
        async for model in client.models.list():
            return str(model.id)
    raise SystemExit(f"{url}/models lists no model; pass --model")


async def run(
    target: Target, workload: Workload, points: Sequence[LoadPoint], slo: Slo,
    *, show_progress: bool = True, on_point: Callable[[dict[str, Any]], None] | None = None,
    processes: int = 1, replicas: Sequence[str] = (),
) -> list[dict[str, Any]]:  # fmt: skip
    """Every load point in turn: its parameters, summary, the load average and every request.
    `processes`: client processes per open-loop point (a closed loop always runs in this one,
    so it refuses `replicas`); `replicas`: see `shard_urls`."""
    reports = []
    for point in points:
        loadavg_before = list(os.getloadavg())
        n = processes if point.arrival != "closed" else 1
        results, busy = await run_point_measured(
            target, workload, point, show_progress=show_progress, processes=n,
            replicas=replicas,
        )  # fmt: skip
        report = {
            "label": point.label,
            "client": {"processes": n, "busiest_cpu_fraction": busy, "bound": busy >= CLIENT_BOUND},
            "point": {k: _json_number(v) for k, v in asdict(point).items()},
            "summary": summarize(results, slo),
            "loadavg_before": loadavg_before,
            "loadavg_after": list(os.getloadavg()),
            "requests": [request_record(r) for r in results],
        }
        reports.append(report)
        if on_point is not None:
            on_point(report)
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(
        args.prompt_tokens, args.output_tokens, args.shared_prefixes, args.prefix_tokens,
        args.long_context_fraction, args.long_context_tokens, args.seed,
    )  # fmt: skip
    model = args.model or asyncio.run(_served_model(args.url, args.api_key))
    target = Target(args.url, model, args.api_key, args.endpoint, args.temperature,
                    args.timeout_s, args.extra_body)  # fmt: skip
    slo = Slo(args.slo_ttft_s, args.slo_itl_s, args.slo_itl_stat, args.slo_tpot_s)
    env = machine()
    points = asyncio.run(
        run(
            target,
            workload,
            load_points(args),
            slo,
            show_progress=not args.quiet,
            processes=args.client_processes,
        )
    )
    print(table(points))
    if args.out:
        config = {k: (str(v) if isinstance(v, Lengths | Path) else v)
                  for k, v in vars(args).items() if k != "api_key"}  # fmt: skip
        report = {"config": {**config, "model": model}, "machine": env, "points": points}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        for path in plot(points, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    errors = sum(p["summary"]["num_errors"] for p in points)
    return 1 if errors and errors == sum(p["summary"]["num_requests"] for p in points) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--shard"]:  # a child of _run_sharded
        asyncio.run(_shard_main(int(sys.argv[2])))
        sys.exit(0)
    sys.exit(main())
