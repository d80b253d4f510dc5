"""A load generator for any OpenAI-compatible endpoint (kvrail's router, vLLM, SGLang, ...).

    .venv/bin/python -P bench/loadgen --url http://127.0.0.1:8000/v1 \\
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

Modules: `workload` (prompts, lengths, arrival schedules; pure), `stats` (per-request results,
percentiles, SLOs, a point's summary; pure), `client` (one streamed request, the open and closed
loops), `shards` (an open loop shared out over client processes), `points` (load points in turn),
`report` (JSON records, the table, the plots) and `cli` (the command line; `__main__` runs it).
This module re-exports what the bench scripts use. They load the package by path, as
`load_script("kvrail_bench_loadgen", BENCH / "loadgen" / "__init__.py")`: bench/ is not a
package. The pure parts are tested in tests/unit/bench/test_loadgen.py.
"""

from .cli import load_points, main, parse_args
from .client import (
    Endpoint,
    LoadPoint,
    Progress,
    Target,
    _chunk_text,
    in_shard,
    send_request,
    stream_into,
)
from .points import CLIENT_BOUND, run, run_point, run_point_measured, shard_urls
from .report import machine, plot, request_record, table
from .shards import _workload_from
from .stats import (
    ItlStat,
    RequestResult,
    Slo,
    distribution,
    meets_slo,
    percentile,
    request_itl_s,
    summarize,
)
from .workload import (
    WORDS,
    Arrival,
    Lengths,
    RequestSpec,
    Workload,
    arrival_times,
    make_request,
    system_prompts,
    words,
)

__all__ = [
    "CLIENT_BOUND", "WORDS", "Arrival", "Endpoint", "ItlStat", "Lengths", "LoadPoint",
    "Progress", "RequestResult", "RequestSpec", "Slo", "Target", "Workload", "_chunk_text",
    "_workload_from", "arrival_times", "distribution", "in_shard", "load_points", "machine",
    "main", "make_request", "meets_slo", "parse_args", "percentile", "plot", "request_itl_s",
    "request_record", "run", "run_point", "run_point_measured", "send_request", "shard_urls",
    "stream_into", "summarize", "system_prompts", "table", "words",
]  # fmt: skip
