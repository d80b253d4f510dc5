"""A load generator for any OpenAI-compatible endpoint: the command line (see the package's
docstring, `bench/loadgen/__init__.py`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import openai

from .client import LoadPoint, Target
from .points import run
from .report import machine, plot, table
from .stats import Slo
from .workload import Lengths, Workload

DESCRIPTION = (
    "A load generator for any OpenAI-compatible endpoint (kvrail's router, vLLM, SGLang, ...)."
)


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
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
