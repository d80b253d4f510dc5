"""Per-step CPU overhead of the engine, per number of running requests (issue 3).

A tiny random Llama (2 layers, hidden 64, 4 heads, 2 KV heads) keeps the math small, so what a
step costs is mostly the engine's own Python: scheduling, block tables, input preparation,
sampling, stop checks and outputs. The vocabulary defaults to 512: with 32,000 the CPU's LM head,
argmax and top-p sort (microseconds on a GPU) take most of a step at N=256 and hide the Python.
For each N it reports the median wall time of a step in

- `decode`: N requests all decoding (N requests of `--prompt-tokens` prompt, prefilled first);
- `mixed`: a serving loop that keeps N requests in flight (random 8..`--max-tokens` outputs), so
  most steps decode the running requests and prefill a few new arrivals;

each with greedy requests and with sampled ones (temperature 0.8, top-p 0.9, and a seed on
every 4th request: seeded rows draw from their own generators, one call each). Then a cProfile
of greedy decode steps at the largest N (top entries by cumulative and own time).

Run: KVRAIL_TORCH_NUM_THREADS=1 .venv/bin/python -P bench/engine/cpu_step_overhead.py \
         | tee bench/engine/cpu_step_overhead.txt
To measure another copy of the engine (say, before a change), put a folder whose `kvrail/` holds
it first on PYTHONPATH; the header names the engine that ran.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import random
import statistics
import sys
import time
from typing import Any

import torch

GREEDY = "greedy"
SAMPLED = "sampled"


def build_engine(args: argparse.Namespace, num_seqs: int) -> Any:
    from kvrail.worker.testing import make_engine, tiny_llama_config

    hf_config = tiny_llama_config(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    tokens_per_request = args.prompt_tokens + args.max_tokens
    num_blocks = 2 * num_seqs * (tokens_per_request // 16 + 1) + 8  # never preempts
    return make_engine(
        hf_config,
        seed=0,
        num_blocks=num_blocks,
        block_size=16,
        max_num_batched_tokens=2048,
        max_num_seqs=num_seqs,
        max_model_len=1024,
    )


class StepRecorder:
    """Wraps the engine's scheduler, so each step's decode and prefill counts are known, and
    its model, so the time of the model's math (forward pass and LM head) is known."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.num_decodes = 0
        self.num_prefills = 0
        self.model_s = 0.0
        schedule = engine.scheduler.schedule

        def recording_schedule() -> Any:
            out = schedule()
            self.num_decodes, self.num_prefills = len(out.decodes), len(out.prefills)
            return out

        engine.scheduler.schedule = recording_schedule
        model = engine.model
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            result = method(*args)
            self.model_s += time.perf_counter() - started
            return result

        return timed

    def timed_step(self) -> tuple[float, float]:
        """(wall seconds of one step, of it outside the model's math)."""
        self.model_s = 0.0
        started = time.perf_counter()
        self.engine.step()
        elapsed = time.perf_counter() - started
        return elapsed, elapsed - self.model_s


def make_params(kind: str, max_tokens: int, seed: int) -> Any:
    from kvrail.sampling import SamplingParams

    if kind == GREEDY:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.8,
        top_p=0.9,
        seed=seed if seed % 4 == 0 else None,
        ignore_eos=True,
    )


def prompt(rng: random.Random, args: argparse.Namespace) -> list[int]:
    return [rng.randrange(10, args.vocab) for _ in range(args.prompt_tokens)]


def decode_steps(args: argparse.Namespace, num_seqs: int, kind: str) -> list[tuple[float, float]]:
    """(wall, outside-the-model) times of pure-decode steps with `num_seqs` requests running."""
    engine = build_engine(args, num_seqs)
    recorder = StepRecorder(engine)
    rng = random.Random(0)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", prompt(rng, args), make_params(kind, args.max_tokens, i))
    while recorder.num_prefills or not recorder.num_decodes:  # prefill everything first
        engine.step()
    times = []
    for _ in range(args.steps):
        elapsed = recorder.timed_step()
        if recorder.num_decodes == num_seqs and not recorder.num_prefills:
            times.append(elapsed)
    return times


def mixed_steps(
    args: argparse.Namespace, num_seqs: int, kind: str
) -> tuple[list[tuple[float, float]], int]:
    """(wall, outside-the-model) times of steps that decode and prefill, keeping `num_seqs`
    requests in flight; and the median number of prefill chunks in them."""
    engine = build_engine(args, num_seqs)
    recorder = StepRecorder(engine)
    rng = random.Random(0)
    next_id = 0
    times, prefills = [], []
    for step in range(args.warmup_steps + args.steps):
        while engine.scheduler.num_unfinished < num_seqs:
            max_tokens = rng.randint(8, args.max_tokens)
            params = make_params(kind, max_tokens, next_id)
            engine.add_request(f"r{next_id}", prompt(rng, args), params)
            next_id += 1
        elapsed = recorder.timed_step()
        if step >= args.warmup_steps and recorder.num_decodes and recorder.num_prefills:
            times.append(elapsed)
            prefills.append(recorder.num_prefills)
    return times, int(statistics.median(prefills)) if prefills else 0


def measure(args: argparse.Namespace, num_seqs: int, kind: str) -> list[float]:
    """Median ms of a decode step, of its part outside the model, and the same for a mixed
    step, over `args.repeats` runs of each; and the median number of prefills per mixed step."""
    decode_times: list[tuple[float, float]] = []
    mixed_times: list[tuple[float, float]] = []
    num_prefills: list[int] = []
    for _ in range(args.repeats):
        decode_times.extend(decode_steps(args, num_seqs, kind))
        times, prefills = mixed_steps(args, num_seqs, kind)
        mixed_times.extend(times)
        num_prefills.append(prefills)
    medians = []
    for times in (decode_times, mixed_times):
        medians.append(1e3 * statistics.median(wall for wall, _ in times))
        medians.append(1e3 * statistics.median(host for _, host in times))
    return [*medians, statistics.median(num_prefills)]


def profile_decode(args: argparse.Namespace, num_seqs: int) -> str:
    engine = build_engine(args, num_seqs)
    recorder = StepRecorder(engine)
    rng = random.Random(0)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", prompt(rng, args), make_params(GREEDY, args.max_tokens, i))
    while recorder.num_prefills or not recorder.num_decodes:
        engine.step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    text = io.StringIO()
    for order in ("cumulative", "tottime"):
        text.write(f"\n## cProfile, {args.steps} greedy decode steps at N={num_seqs}, by {order}\n")
        stats = pstats.Stats(profiler, stream=text)
        stats.strip_dirs().sort_stats(order).print_stats(25)
    return text.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup-steps", type=int, default=40, help="mixed: untimed steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    threads = int(os.environ.get("KVRAIL_TORCH_NUM_THREADS", "1"))
    torch.set_num_threads(threads)

    import kvrail.worker.engine

    print(f"# {' '.join(sys.argv)}")
    print(f"# engine: {os.path.dirname(kvrail.worker.engine.__file__)}")
    print(
        f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"threads={threads}, cpus={os.cpu_count()}, vocab={args.vocab}, "
        f"prompt={args.prompt_tokens}, max_tokens={args.max_tokens}, repeats={args.repeats}"
    )
    print("# median ms per step: wall, and outside the model's math (forward + LM head), the")
    print("# engine's own work; mixed steps decode N - p requests and prefill p new ones")
    print("    N  sampling  decode_ms  engine_ms  engine_us/req   mixed_ms  engine_ms  prefills")
    for num_seqs in args.num_seqs:
        for kind in (GREEDY, SAMPLED):
            decode_ms, decode_host_ms, mixed_ms, mixed_host_ms, prefills = measure(
                args, num_seqs, kind
            )
            print(
                f"{num_seqs:5d}  {kind:8s} {decode_ms:10.2f} {decode_host_ms:10.2f} "
                f"{1e3 * decode_host_ms / num_seqs:14.1f} {mixed_ms:10.2f} {mixed_host_ms:10.2f} "
                f"{prefills:9.0f}",
                flush=True,
            )
    if not args.no_profile:
        print(profile_decode(args, max(args.num_seqs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
