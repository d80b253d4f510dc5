"""The engine at TP=1, 2 and 4 on H200s: a Llama-3-8B-shaped model (random bf16 weights), issue 25's
figures for the multi-GPU run (issue 26). Not run yet: this machine has no GPU.

For each tensor-parallel size that the machine's GPUs allow, in one process (the ranks in their
own, as a worker runs them: `kvrail.worker.ranks.build.build_engine`):

1. greedy tokens of a few prompts, 64 each, against TP=1: where bf16 first diverges, if it does
   (the sums of a split projection run in another order);
2. batch-1 decode tokens/s (prompt 128, 256 new tokens), decode phase only;
3. 32 concurrent requests of 512 prompt / 128 output tokens: output tokens/s and the decode
   phase's mean step time (after the last first token);
4. prefill of 8,192 tokens: seconds to the first token, median of three prompts.

The paper figures to hold these against: `cpu_tensor_parallel.py --paper-only` (on this tree:
bench/engine/cpu_tensor_parallel.txt, last section).

The model directory (16 GB) is written once to `--model-dir` and reused.

Run on the multi-GPU machine (4 x H200 for TP=4; 2 for TP=1/2):
  python3 -P bench/engine/gpu_tensor_parallel.py --tp 1 2 4 \
      | tee bench/engine/gpu_tensor_parallel.txt
`--smoke`: a tiny model on CPU over gloo (TP=1 and 2, short runs), to check the script here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192 + 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192},
}  # fmt: skip
SMOKE: dict[str, Any] = {
    "vocab_size": 49155, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
}  # fmt: skip


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40_000, (n, length), generator=g).tolist()


def run_until_done(engine: Any) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def measure(built: Any, args: argparse.Namespace) -> dict[str, Any]:
    from kvrail.sampling import SamplingParams

    engine, device = built.engine, args.device
    out: dict[str, Any] = {}
    greedy = SamplingParams(max_tokens=args.correctness_tokens, ignore_eos=True)
    out["tokens"] = engine.generate(prompts(3, 48, seed=1), greedy)
    # batch 1
    engine.add_request("b1", prompts(1, 128, seed=2)[0],
                       SamplingParams(max_tokens=args.b1_tokens, ignore_eos=True))  # fmt: skip
    request = engine.scheduler.requests["b1"]
    while not request.output_token_ids:
        engine.step()
    sync(device)
    started = time.perf_counter()
    run_until_done(engine)
    sync(device)
    out["batch1_tok_s"] = (args.b1_tokens - 1) / (time.perf_counter() - started)
    # 32 x 512 / 128
    batch = [
        engine.add_request(f"c{i}", p, SamplingParams(max_tokens=args.out_tokens, ignore_eos=True))
        for i, p in enumerate(prompts(32, args.in_tokens, seed=3))
    ]
    sync(device)
    started = time.perf_counter()
    steps_after = 0
    first_all = None
    while engine.has_unfinished_requests():
        engine.step()
        if first_all is None and all(r.output_token_ids for r in batch):
            sync(device)
            first_all = time.perf_counter()
        elif first_all is not None:
            steps_after += 1
    sync(device)
    ended = time.perf_counter()
    out["c32_tok_s"] = 32 * args.out_tokens / (ended - started)
    out["c32_decode_step_ms"] = (ended - (first_all or ended)) / max(steps_after, 1) * 1e3
    # prefill
    times = []
    for seed in (4, 5, 6):
        engine.add_request(f"p{seed}", prompts(1, args.prefill_tokens, seed)[0],
                           SamplingParams(max_tokens=1, ignore_eos=True))  # fmt: skip
        sync(device)
        started = time.perf_counter()
        run_until_done(engine)
        sync(device)
        times.append(time.perf_counter() - started)
    out["prefill_s"] = statistics.median(times)
    return out


def first_divergence(a: list[list[int]], b: list[list[int]]) -> str:
    for p, (x, y) in enumerate(zip(a, b, strict=True)):
        for i, (s, t) in enumerate(zip(x, y, strict=True)):
            if s != t:
                return f"prompt {p} token {i}"
    return "identical"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/kvrail-llama3-8b-random"))
    parser.add_argument("--kv-gib", type=float, default=20.0)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    from kvrail.worker.engine.config import EngineConfig
    from kvrail.worker.kv_cache import KVCache
    from kvrail.worker.ranks.build import build_engine
    from kvrail.worker.testing import write_random_model

    shape = SMOKE if args.smoke else LLAMA3_8B
    args.device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    small = args.smoke
    args.correctness_tokens, args.b1_tokens = (8, 16) if small else (64, 256)
    args.in_tokens, args.out_tokens, args.prefill_tokens = (
        (32, 8, 256) if small else (512, 128, 8192)
    )
    if args.smoke:
        args.model_dir = Path("/tmp/kvrail-tp-smoke")
    if not (args.model_dir / "model.safetensors").is_file():
        started = time.monotonic()
        write_random_model(args.model_dir, seed=0, dtype=dtype, **shape)
        print(f"model written to {args.model_dir} in {time.monotonic() - started:.0f}s")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    sizes = [t for t in args.tp if (args.smoke and t <= 2) or t <= gpus]
    name = torch.cuda.get_device_name(0) if gpus else "cpu"
    print(f"# gpu_tensor_parallel: {gpus} GPUs ({name}), torch {torch.__version__}, sizes {sizes}")
    results: dict[int, dict[str, Any]] = {}
    for tp in sizes:
        kv_bytes = int(args.kv_gib * 2**30)
        num_blocks = 512 if small else KVCache.num_blocks_for_bytes(
            kv_bytes, shape["num_hidden_layers"], 16, shape["num_key_value_heads"] // tp,
            shape["hidden_size"] // shape["num_attention_heads"], dtype,
        )  # fmt: skip
        config = EngineConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=256,
                              max_num_batched_tokens=16384 if not small else 512,
                              max_model_len=8192 + 512 if not small else 1024)  # fmt: skip
        started = time.monotonic()
        built = build_engine(
            str(args.model_dir), config, dtype=dtype, device_type=args.device,
            tensor_parallel_size=tp, torch_num_threads=1 if small else None,
        )  # fmt: skip
        print(f"TP={tp}: built in {time.monotonic() - started:.0f}s, {num_blocks} blocks per rank")
        try:
            results[tp] = measure(built, args)
        finally:
            if built.ranks is not None:
                built.ranks.close()
            built.engine.model.group.close()
            del built
            if gpus:
                torch.cuda.empty_cache()
    print("| TP | batch-1 decode tok/s | 32 x 512/128 output tok/s | decode step at 32 (ms) | "
          "prefill (s) | greedy vs TP=1 |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    base = results.get(1, {}).get("tokens")
    for tp, r in results.items():
        same = first_divergence(base, r["tokens"]) if base is not None else "-"
        print(f"| {tp} | {r['batch1_tok_s']:.1f} | {r['c32_tok_s']:,.0f} | "
              f"{r['c32_decode_step_ms']:.2f} | {r['prefill_s']:.3f} | {same} |")  # fmt: skip
    print(f"machine: {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
