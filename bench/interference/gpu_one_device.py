"""Interference on one GPU: a user decoding while a long prompt is prefilled (issues 4 and 8).

    python3 -P bench/interference/gpu_one_device.py --out $OUT/interference-h200.json   # H200
    .venv/bin/python -P bench/interference/gpu_one_device.py --smoke                    # CPU check

The engine in Llama-3-8B shape (random bf16 weights), no etcd, NATS or KV transfer: this isolates
what the GPU does to user A's inter-token gaps when user B's long prompt (4k / 16k / 32k tokens)
is prefilled

- `colocated`: by A's own engine, in one step (token budget >= the prompt);
- `chunked-2048`, `chunked-512`: by A's own engine in chunks of that many tokens per step, mixed
  with A's decode steps;
- `two-process`: by a second engine in its own process on the same GPU (what a prefill worker
  next to a decode worker on one GPU does; the GPU time-slices between the two contexts);
- `two-process-mps-<p>`: the same under CUDA MPS with the prefill process limited to p% of the
  SMs (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`), when an MPS control daemon can be started here;
- `two-gpu`: the two processes of `two-process`, the prefill one on another GPU
  (`CUDA_VISIBLE_DEVICES=--prefill-gpu` for it, `--decode-gpu` for the decode one): a prefill
  worker and a decode worker with a GPU each. The KV handoff is not part of it (bench/transfer/).

    python3 -P bench/interference/gpu_one_device.py --modes two-process,two-gpu \
        --lengths 16384 --out $OUT/interference-h200x2.json                     # 2 H200s

A decodes `--a-tokens` tokens (batch 1, CUDA graphs as in production); B arrives after A's
`--b-after`-th token with max_tokens 1. Every engine first runs one prefill of B's length so no
Triton compilation lands in the measurement. Reported per mode and prompt length: A's median gap
before B, max and p99 gap while B is in flight, gaps above 3x the median, and B's TTFT.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

LLAMA3_8B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 128000,
    "eos_token_id": 128001,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192},
}  # fmt: skip
SMOKE: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def build_engine(smoke: bool, max_len: int, budget: int) -> Any:
    import torch
    from transformers import LlamaConfig

    from kvrail.worker.engine.config import EngineConfig
    from kvrail.worker.engine.engine import LLMEngine, make_fingerprint
    from kvrail.worker.kv_cache import KVCache
    from kvrail.worker.models.llama import LlamaForCausalLM

    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    config = LlamaConfig(**(SMOKE if smoke else LLAMA3_8B), max_position_embeddings=max_len)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        model.init_random(seed=0)
    shape = model.shape
    kv_bytes = int((0.05 if smoke else 10) * 2**30)
    num_blocks = KVCache.num_blocks_for_bytes(
        kv_bytes, shape.num_layers, 16, shape.num_kv_heads, shape.head_dim, dtype
    )
    engine_config = EngineConfig(
        num_blocks=num_blocks, block_size=16, max_model_len=max_len,
        max_num_batched_tokens=budget, max_num_seqs=8, enable_cuda_graphs=not smoke,
    )  # fmt: skip
    fingerprint = make_fingerprint(model, engine_config, "random", "none")
    return LLMEngine(model, engine_config, fingerprint, eos_token_id=None)


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab - 1) for _ in range(length)]


def params(max_tokens: int) -> Any:
    from kvrail.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_to_completion(engine: Any, request_id: str) -> float:
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return time.perf_counter() - started
    return time.perf_counter() - started


def warm_up(engine: Any, long_len: int, vocab: int, mixed: bool) -> None:
    """Run the measured pattern once, so Triton compiles every kernel shape first: a long
    prefill alone, and (`mixed`) one that arrives while another request decodes."""
    engine.add_request("warm-long", prompt(long_len, 99, vocab), params(1))
    run_to_completion(engine, "warm-long")
    engine.add_request("warm-decode", prompt(64, 98, vocab), params(24))
    for _ in range(4):
        engine.step()
    if mixed:
        engine.add_request("warm-mixed", prompt(long_len, 97, vocab), params(1))
    run_to_completion(engine, "warm-decode")
    while engine.has_unfinished_requests():
        engine.step()


def decode_user(
    args: argparse.Namespace,
    long_len: int,
    budget: int,
    colocated: bool,
    go: Any = None,
    done: Any = None,
    ready: Any = None,
) -> dict[str, Any]:
    """User A's engine: A's token times; with `colocated`, B is added here, else `go` is set and
    the other process's `done` is awaited (polled between A's steps)."""
    vocab = SMOKE["vocab_size"] if args.smoke else 120_000
    engine = build_engine(args.smoke, long_len + 1024, budget)
    warm_up(engine, long_len if colocated else 64, vocab, mixed=colocated)
    if ready is not None:
        ready.wait(900)  # the prefill process is warm too
    engine.add_request("a", prompt(128, 1, vocab), params(args.a_tokens))
    times: list[float] = []
    b_sent = b_done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "a":
                now = time.perf_counter()
                times.extend([now] * len(out.token_ids))
                if len(times) == args.b_after and b_sent is None:
                    b_sent = now
                    if colocated:
                        engine.add_request("b", prompt(long_len, 2, vocab), params(1))
                    else:
                        go.set()
            elif out.request_id == "b" and out.finished:
                b_done = time.perf_counter()
        if not colocated and b_sent is not None and b_done is None and done.is_set():
            b_done = time.perf_counter()
    if not colocated and b_done is None:
        done.wait(600)
        b_done = time.perf_counter()
    return {"times": times, "b_sent": b_sent, "b_done": b_done}


def prefill_user(args: argparse.Namespace, long_len: int, go: Any, done: Any, ready: Any) -> None:
    vocab = SMOKE["vocab_size"] if args.smoke else 120_000
    engine = build_engine(args.smoke, long_len + 1024, long_len + 16)
    warm_up(engine, long_len, vocab, mixed=False)
    ready.set()
    go.wait(600)
    engine.add_request("b", prompt(long_len, 2, vocab), params(1))
    run_to_completion(engine, "b")
    done.set()


def _decode_proc(args: argparse.Namespace, long_len: int, go: Any, done: Any, ready: Any,
                 q: Any) -> None:  # fmt: skip
    q.put(decode_user(args, long_len, 2048, False, go, done, ready))


def gpus_for(mode: str, args: argparse.Namespace) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES of the (prefill, decode) processes of a two-process mode; empty
    where they share what the parent sees (one GPU, or the CPU smoke run)."""
    if mode != "two-gpu" or args.smoke:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else None  # indices count within what we see
    pick = (lambda i: names[i]) if names else str
    return {"prefill": pick(args.prefill_gpu), "decode": pick(args.decode_gpu)}


def summarize(raw: dict[str, Any], b_after: int) -> dict[str, float]:
    times, b_sent, b_done = raw["times"], raw["b_sent"], raw["b_done"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    before = gaps[: b_after - 1]
    during = [g for t, g in zip(times[1:], gaps, strict=False) if b_sent <= t <= b_done + 0.5]
    median = statistics.median(before)
    ordered = sorted(gaps)
    return {
        "median_gap_before_ms": 1000 * median,
        "max_gap_while_b_ms": 1000 * max(during, default=0.0),
        "p99_gap_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "gaps_over_3x_median": sum(1 for g in gaps if g > 3 * median),
        "b_ttft_s": b_done - b_sent,
    }


def start_mps() -> tuple[bool, str]:
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return False, "nvidia-cuda-mps-control is not installed on this machine"
    os.environ["CUDA_MPS_PIPE_DIRECTORY"] = "/tmp/kvrail-mps-pipe"
    os.environ["CUDA_MPS_LOG_DIRECTORY"] = "/tmp/kvrail-mps-log"
    for d in ("/tmp/kvrail-mps-pipe", "/tmp/kvrail-mps-log"):
        os.makedirs(d, exist_ok=True)
    done = subprocess.run([control, "-d"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return False, f"nvidia-cuda-mps-control -d failed: {done.stderr.strip() or done.returncode}"
    return True, "started"


def stop_mps() -> None:
    control = shutil.which("nvidia-cuda-mps-control")
    if control:
        subprocess.run([control], input="quit\n", text=True, capture_output=True, timeout=30)


def save(args: argparse.Namespace, notes: dict[str, str], results: list[dict[str, Any]]) -> None:
    output = {"command": " ".join(sys.argv), "a_tokens": args.a_tokens, "b_after": args.b_after,
              "notes": notes, "results": results}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(output, f, indent=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,16384,32768")
    parser.add_argument("--modes", default="colocated,chunked-2048,chunked-512,two-process,mps-50")
    parser.add_argument("--a-tokens", type=int, default=200)
    parser.add_argument("--b-after", type=int, default=60)
    parser.add_argument("--prefill-gpu", type=int, default=1, help="two-gpu: the prefill's GPU")
    parser.add_argument("--decode-gpu", type=int, default=0, help="two-gpu: the decode's GPU")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, short prompts")
    parser.add_argument("--out", default="interference-gpu.json", help="rewritten after each row")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.smoke:
        lengths, args.a_tokens, args.b_after = [256], 40, 10
    ctx = mp.get_context("spawn")
    results: list[dict[str, Any]] = []
    notes: dict[str, str] = {}
    for mode in args.modes.split(","):
        mps_pct = int(mode.split("-")[1]) if mode.startswith("mps-") else None
        if mps_pct is not None:
            if args.smoke:
                continue
            ok, why = start_mps()
            notes[mode] = why
            if not ok:
                print(f"{mode}: skipped: {why}", flush=True)
                continue
        try:
            for long_len in lengths:
                started = time.perf_counter()
                if mode in ("colocated",) or mode.startswith("chunked-"):
                    budget = long_len + 16 if mode == "colocated" else int(mode.split("-")[1])
                    raw = decode_user(args, long_len, budget, True)
                else:
                    go, done, ready = ctx.Event(), ctx.Event(), ctx.Event()
                    q = ctx.Queue()
                    env_before = dict(os.environ)
                    gpus = gpus_for(mode, args)
                    if mps_pct is not None:
                        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps_pct)
                    if gpus:  # a spawned process takes the environment as it is at start()
                        os.environ["CUDA_VISIBLE_DEVICES"] = gpus["prefill"]
                    pre = ctx.Process(target=prefill_user, args=(args, long_len, go, done, ready))
                    pre.start()
                    if mps_pct is not None:
                        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 - mps_pct)
                    if gpus:
                        os.environ["CUDA_VISIBLE_DEVICES"] = gpus["decode"]
                    dec = ctx.Process(target=_decode_proc,
                                      args=(args, long_len, go, done, ready, q))  # fmt: skip
                    dec.start()
                    raw = q.get(timeout=1200)
                    dec.join(60)
                    pre.join(60)
                    os.environ.clear()
                    os.environ.update(env_before)
                row = {"mode": mode, "prompt_tokens": long_len, **summarize(raw, args.b_after),
                       "seconds": time.perf_counter() - started}  # fmt: skip
                if mode not in ("colocated",) and not mode.startswith("chunked-"):
                    row["cuda_visible_devices"] = gpus_for(mode, args) or "inherited"
                results.append(row)
                print(json.dumps(row), flush=True)
                save(args, notes, results)
        finally:
            if mps_pct is not None:
                stop_mps()
    save(args, notes, results)
    print("| mode | B prompt | median gap before (ms) | max gap while B (ms) | p99 gap (ms) "
          "| gaps > 3x | B TTFT (s) |\n|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in results:
        print(f"| {r['mode']} | {r['prompt_tokens']} | {r['median_gap_before_ms']:.1f} | "
              f"{r['max_gap_while_b_ms']:.1f} | {r['p99_gap_ms']:.1f} | "
              f"{r['gaps_over_3x_median']} | {r['b_ttft_s']:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
