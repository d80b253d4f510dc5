"""What `n` > 1 gains the engine (Llama-3-8B shape, random bf16 weights): 32 prompts with 8
choices each against 256 distinct prompts, 512 prompt / 128 output tokens, seeded sampling.

The 8 choices go to the engine as the router sends them (`kvrail.router.choices`): the first
choice of each prompt alone, and its 7 others (seeds + 1 to + 7) as soon as it has its first
token, when its prompt's full blocks are in the prefix cache: they compute only the prompt's last
partial block. The choices' decode steps run twice: reading the prompt's shared blocks once per
prompt (`shared_prefix_decode`, off by default, on in this engine;
`kvrail.kernels.prefix_attention`) and once per choice ("whole": every row its whole context, as
before). Measured in the order a, b, c, a, b, c after one untimed run of each
(`gpu_llama3_8b.alternate`). vLLM's side is bench/engine/vllm_sampling.py.

Run on the lent GPU (from the repository root, after `source hack/device-env.sh`):
  python3 -P bench/engine/gpu_choices.py | tee bench/engine/gpu_choices.txt
`--prompt-len` and `--max-tokens` set the lengths (default 512 / 128); `--smoke` runs a tiny
config on the CPU (checks the script end to end).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_llama3_8b as base

_SEEDS = iter(range(100, 10_000))


def run(engine: Any, prompts: int, choices: int, shared: bool, length: int, out: int) -> float:
    """Output tokens/s of `prompts` new prompts of `length` tokens with `choices` choices each,
    `out` tokens per choice; the followers join when their leader has its first token. `shared`:
    decode over shared blocks once per group."""
    from kvrail.sampling import SamplingParams

    engine.runner.shared_prefixes = shared

    batch = base.prompts(prompts, length, seed=next(_SEEDS))
    seed = next(_SEEDS) * 1000

    def params(index: int) -> SamplingParams:
        return SamplingParams(max_tokens=out, ignore_eos=True, temperature=1.0, seed=seed + index)

    base.sync()
    started = time.perf_counter()
    leaders = [engine.add_request(f"r{seed}-{i}", p, params(0)) for i, p in enumerate(batch)]
    waiting = dict(enumerate(leaders))
    requests = list(leaders)
    while engine.has_unfinished_requests() or waiting:
        for i, leader in list(waiting.items()):
            if leader.num_output_tokens:
                del waiting[i]
                requests += [
                    engine.add_request(f"r{seed}-{i}-{c}", batch[i], params(c))
                    for c in range(1, choices)
                ]
        engine.step()
    base.sync()
    elapsed = time.perf_counter() - started
    assert all(r.num_output_tokens == out for r in requests)
    return len(requests) * out / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--kv-gib", type=float, default=40.0)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    engine = base.bench_engine(args.smoke, args.kv_gib, shared_prefix_decode=True)
    length, out = (args.prompt_len, args.max_tokens) if not args.smoke else (40, 8)
    shapes = {"n=8 x 32 prompts": (32, 8, True), "n=8 x 32, whole": (32, 8, False),
              "256 prompts": (256, 1, True)}  # fmt: skip
    if args.smoke:
        shapes = {"n=8 x 4 prompts": (4, 8, True), "n=8 x 4, whole": (4, 8, False),
                  "32 prompts": (32, 1, True)}  # fmt: skip
    values = base.alternate(
        dict.fromkeys(shapes, True), lambda mode: run(engine, *shapes[mode], length, out)
    )
    print(f"\n## {length} prompt / {out} output tokens per choice: output tokens/s (two runs each)")
    last = list(shapes)[-1]
    for mode, runs in values.items():
        ratio = sum(runs) / sum(values[last])
        print(f"{mode:18} {base.fmt(runs, '.0f')}   {ratio:.3f}x {last}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
