"""The host KV tier on a multi-turn workload, in the engine (Llama-3-8B shape, random bf16).

N sessions of T turns: a turn's prompt is the session's previous prompt, the previous answer and
a new user message; a session sends its next turn a think time after its answer ends. The GPU KV
pool is set small (`--kv-gib`) so that the sessions' live prefixes are several times what it
holds: without tiers the other sessions evict a session's prefix before its next turn, and it is
computed again; with the host tier (`--host-gib`) it loads back. One engine of each kind over the
same weights, the same sessions, run in the order a, b, a, b. Printed per run:
- prompt tokens computed (prompt tokens minus those served from any cache) and how many came
  from the host tier;
- TTFT p50/p99 (from a turn's submission to its first token, engine time), and the p50 of the
  engine steps a turn's first token took (`engine.step()` calls from its submission to the one
  that returned it: a turn whose prefix loads waits for its load, then joins a step);
- the worst gap between two tokens of one request, over the run (no decode step may wait for an
  offload or a load);
- answers equal: every answer of the tiered run against the plain run's (greedy); with
  `--whole-gib G`, also a third engine whose GPU pool (G GiB) holds every prefix, run first in
  each round, and every answer against its answers. This is not a check of the tier's
  correctness: a turn's prompt holds the session's earlier answers, so one token that differs
  (engines of other pool sizes, or batches timed otherwise, round bf16 differently, and random
  weights' logits are near ties) changes every later prompt of its session, whose answers then
  differ from their first token. On an H100 the whole pool's answers and the plain run's
  differed as much as the host tier's did (gpu_kv_tiers_2026-12-06b.txt). What checks the tier
  is `tests/unit/worker/test_kv_tiers.py` (same tokens with and without tiers, on CUDA too).
Then the host tier's load bandwidth against the link's: 1 GiB of blocks loaded through the tier's
own path (copies on its stream, checksums compared on the GPU) against one pinned 1 GiB
host-to-device copy, in the same process.

    source hack/device-env.sh && python3 -P bench/engine/gpu_kv_tiers.py
    .venv/bin/python -P bench/engine/gpu_kv_tiers.py --smoke      # CPU, tiny model
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvrail.testing.scripts import load_script

HERE = Path(__file__).resolve().parent
base: Any = load_script("kvrail_bench_engine_gpu_llama3_8b", HERE / "gpu_llama3_8b.py")


def run_sessions(engine: Any, args: Any, seed: int) -> dict[str, Any]:
    """Serve every session's turns; returns the measures and each turn's answer."""
    from kvrail.sampling import SamplingParams

    rng = random.Random(seed)  # think times: they depend on the order turns end in
    texts = {s: random.Random(f"{seed}-{s}") for s in range(args.sessions)}  # not the text
    high = 120000 if base.DEVICE == "cuda" else 90
    words = lambda s, n: [texts[s].randrange(3, high) for _ in range(n)]  # noqa: E731
    params = SamplingParams(max_tokens=args.answer, ignore_eos=True)
    prompts = {s: words(s, args.system) for s in range(args.sessions)}
    turns = dict.fromkeys(prompts, 0)
    ready: list[tuple[float, int]] = [(rng.random() * args.think, s) for s in prompts]
    heapq.heapify(ready)
    live: dict[str, tuple[int, Any, float]] = {}
    answers: dict[str, list[int]] = {}
    ttft: list[float] = []  # turns after the first: the ones a cache can serve
    first_ttft: list[float] = []
    computed, from_cache, worst_gap = 0, 0, 0.0
    last_token: dict[str, float] = {}
    num_steps, submitted_step = 0, {}
    steps_to_first: list[int] = []  # turns after the first
    started = time.perf_counter()
    while ready or live:
        now = time.perf_counter() - started
        while ready and ready[0][0] <= now:
            _, s = heapq.heappop(ready)
            prompts[s] += words(s, args.user)
            rid = f"s{s}t{turns[s]}"
            live[rid] = (s, engine.add_request(rid, list(prompts[s]), params), time.perf_counter())
            submitted_step[rid] = num_steps
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        outputs = engine.step()
        num_steps += 1
        for out in outputs:
            t = time.perf_counter()
            s, request, submitted = live[out.request_id]
            if out.request_id not in last_token:
                (ttft if turns[s] else first_ttft).append(t - submitted)
                if turns[s]:
                    steps_to_first.append(num_steps - submitted_step[out.request_id])
                computed += request.num_prompt_tokens - request.num_cached_tokens
                from_cache += request.num_cached_tokens
            else:
                worst_gap = max(worst_gap, t - last_token[out.request_id])
            last_token[out.request_id] = t
            if out.finished:
                answers[out.request_id] = list(request.output_token_ids)
                prompts[s] += request.output_token_ids
                del live[out.request_id]
                turns[s] += 1
                if turns[s] < args.turns:
                    think = rng.expovariate(1 / args.think) if args.think else 0.0
                    heapq.heappush(ready, (time.perf_counter() - started + think, s))
    ttft.sort()
    wall = time.perf_counter() - started
    return {
        "wall": wall, "first_ttft_p50": statistics.median(first_ttft),
        "computed": computed, "cached": from_cache, "answers": answers,
        "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[int(0.99 * (len(ttft) - 1))],
        "worst_gap": worst_gap, "steps_to_first_p50": statistics.median(steps_to_first),
        "final_prompt": max(len(p) for p in prompts.values()),
    }  # fmt: skip


def _agreement(answers: dict[str, list[int]], reference: dict[str, list[int]]) -> str:
    """How many answers equal the plain run's, and where the others first differ: greedy
    decoding over bf16 KV computed in other chunks (a cache hit) may flip a near-tie of random
    weights' logits, late in an answer; a wrong block would differ from the first token."""
    firsts = [
        next((i for i, (x, y) in enumerate(zip(a, reference[rid], strict=True)) if x != y), None)
        for rid, a in answers.items()
    ]
    differ = sorted(i for i in firsts if i is not None)
    where = f", first differing token at {differ[len(differ) // 2]} (median)" if differ else ""
    return f"answers equal {len(firsts) - len(differ)}/{len(firsts)}{where}"


def load_bandwidth(engine: Any, nbytes: int) -> tuple[float, float]:
    """(GB/s of the tier's load path, GB/s of one pinned host-to-device copy), same bytes."""
    tiers = engine.tiers
    copier = tiers.copier
    n = min(nbytes // tiers.block_bytes, tiers.host.num_slots, engine.config.num_blocks - 1)
    slots, blocks = list(range(n)), list(range(1, n + 1))
    checksums = copier.offload(blocks, slots)  # fill the slots (the pool's bytes, whatever)
    base.sync()
    sums = checksums.result()
    rates = []
    for _ in range(3):
        base.sync()
        t = time.perf_counter()
        handle = copier.load(slots, blocks, sums)
        base.sync()
        rates.append(n * tiers.block_bytes / (time.perf_counter() - t) / 1e9)
        assert all(handle.result()), "a load of unchanged bytes failed its checksum"
    src = torch.empty(n * tiers.block_bytes, dtype=torch.uint8, pin_memory=base.DEVICE == "cuda")
    dst = torch.empty_like(src, device=base.DEVICE)
    raw = []
    for _ in range(3):
        base.sync()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        base.sync()
        raw.append(n * tiers.block_bytes / (time.perf_counter() - t) / 1e9)
    return max(rates), max(raw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--kv-gib", type=float, default=2.0, help="the GPU KV pool")
    parser.add_argument("--host-gib", type=float, default=24.0, help="the host tier")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=1024, help="first prompt's tokens")
    parser.add_argument("--user", type=int, default=256, help="tokens a turn adds")
    parser.add_argument("--answer", type=int, default=64, help="tokens of each answer")
    parser.add_argument("--think", type=float, default=0.5, help="mean think time, seconds")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each engine, alternating")
    parser.add_argument("--whole-gib", type=float, default=0.0, help="see the docstring")
    args = parser.parse_args()
    sizes: dict[str, Any] = {"max_num_seqs": 64}
    if args.smoke:  # a pool of 12 blocks, about a quarter of the live prefixes
        args.sessions, args.turns, args.system, args.user, args.answer = 4, 3, 64, 32, 4
        args.think, args.host_gib = 0.0, 0.01
        sizes.update(num_blocks=13, max_model_len=192)
    host_bytes = int(args.host_gib * 2**30)
    hf, config = base.random_model(args.smoke)  # both engines over the very same weights
    graphs = base.DEVICE == "cuda"
    plain = base.warmed(base.build_engine(hf, config, args.kv_gib, graphs, **sizes))
    tiered = base.warmed(base.build_engine(hf, config, args.kv_gib, graphs,
                                           kv_host_tier_bytes=host_bytes, **sizes))  # fmt: skip
    engines = [("plain", plain), ("host tier", tiered)]
    if args.whole_gib:
        whole_sizes = {**sizes, "num_blocks": 400} if args.smoke else sizes
        whole = base.warmed(base.build_engine(hf, config, args.whole_gib, graphs, **whole_sizes))
        engines.insert(0, ("whole pool", whole))
    del hf
    pool_tokens = (plain.config.num_blocks - 1) * plain.config.block_size
    print(f"# GPU KV pool {pool_tokens} tokens; host tier {args.host_gib} GiB; "
          f"{args.sessions} sessions x {args.turns} turns")  # fmt: skip
    reference: dict[str, list[int]] = {}
    whole_answers: dict[str, list[int]] = {}
    for round_ in range(args.rounds):
        for name, engine in engines:
            r = run_sessions(engine, args, seed=round_)
            if name == "plain":
                reference = r["answers"]
            if name == "whole pool":
                whole_answers = r["answers"]
            same = _agreement(r["answers"], reference) if name != "whole pool" else ""
            if whole_answers and name != "whole pool":
                same += "; against the whole pool's: " + _agreement(r["answers"], whole_answers)
            live = args.sessions * r["final_prompt"] / pool_tokens
            print(f"{name:10s} round {round_}: prompt tokens computed {r['computed']:8d} "
                  f"cached {r['cached']:8d}  TTFT p50 {r['ttft_p50'] * 1e3:8.1f} ms "
                  f"p99 {r['ttft_p99'] * 1e3:8.1f} ms steps {r['steps_to_first_p50']:.0f} "
                  f"(turns 2+; turn 1 p50 "
                  f"{r['first_ttft_p50'] * 1e3:.0f} ms)  worst token gap "
                  f"{r['worst_gap'] * 1e3:7.1f} ms  {r['wall']:.1f} s  live prefixes "
                  f"{live:.1f}x the pool  {same}")  # fmt: skip
    tier_gbs, raw_gbs = load_bandwidth(tiered, 1 << 30 if not args.smoke else 1 << 20)
    print(f"host tier load {tier_gbs:.1f} GB/s (copies + GPU checksums) vs one pinned "
          f"host-to-device copy {raw_gbs:.1f} GB/s: {tier_gbs / raw_gbs:.0%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
