"""What logprobs and prompt scores cost the engine (Llama-3-8B shape, random bf16 weights).

One engine, the same requests asked three ways, in the order a, b, c, a, b, c after one untimed
run of each (`gpu_llama3_8b.alternate`; these machines drift):

1. 256 concurrent requests of 512 prompt / 128 output tokens: output tokens/s with no logprobs,
   with `logprobs=5` on every row (the issue's `top_logprobs: 5`), and with `logprobs=0`;
2. 64 scoring requests of 512 prompt tokens and `max_tokens=1` (lm-eval's loglikelihood shape):
   prompt tokens/s without scores and with `prompt_logprobs=1` (every prompt position scored:
   its logits made `scores.SCORE_SLICE_ROWS` rows at a time, a log-softmax over 128,256 tokens).

The issue's target for (1): with logprobs at least 0.95x the same run without. vLLM is not run
here (no vLLM bundle on the lent GPU in this session); see bench/engine/README.md.

Run on the lent GPU (from the repository root, after `source hack/device-env.sh`):
  python3 -P bench/engine/gpu_logprobs.py | tee bench/engine/gpu_logprobs.txt
`--prompt-len` and `--max-tokens` set (1)'s lengths (default 512 / 128; (2) keeps 512 prompt
tokens unless `--prompt-len` says otherwise); `--smoke` runs a tiny config on the CPU (checks
the script end to end).
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


def run(engine: Any, n: int, length: int, params: Any) -> float:
    """Seconds to run `n` new prompts of `length` tokens to completion with `params` (new
    prompts each run, so that none is served from the prefix cache)."""
    batch = base.prompts(n, length, seed=next(_SEEDS))
    base.sync()
    started = time.perf_counter()
    requests = [engine.add_request(f"r{started}-{i}", p, params) for i, p in enumerate(batch)]
    while engine.has_unfinished_requests():
        engine.step()
    base.sync()
    assert all(r.num_output_tokens == params.max_tokens for r in requests)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--kv-gib", type=float, default=40.0)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    from kvrail.sampling import SamplingParams

    engine = base.bench_engine(args.smoke, args.kv_gib)
    n, prompt, out = (256, args.prompt_len, args.max_tokens) if not args.smoke else (8, 32, 8)
    asks = {
        "none": SamplingParams(max_tokens=out, ignore_eos=True),
        "logprobs=5": SamplingParams(max_tokens=out, ignore_eos=True, logprobs=5),
        "logprobs=0": SamplingParams(max_tokens=out, ignore_eos=True, logprobs=0),
    }
    values = base.alternate(
        dict.fromkeys(asks, True), lambda mode: n * out / run(engine, n, prompt, asks[mode])
    )
    print(f"\n## {n} requests of {prompt} / {out} tokens: output tokens/s (two runs each)")
    for mode, runs in values.items():
        ratio = sum(runs) / sum(values["none"])
        print(f"{mode:12} {base.fmt(runs, '.0f')}   {ratio:.3f}x none")
    n_scored = 64 if not args.smoke else 4
    scored = {
        "no scores": SamplingParams(max_tokens=1),
        "prompt_logprobs=1": SamplingParams(max_tokens=1, prompt_logprobs=1),
    }
    values = base.alternate(
        dict.fromkeys(scored, True),
        lambda mode: n_scored * prompt / run(engine, n_scored, prompt, scored[mode]),
    )
    print(f"\n## {n_scored} requests of {prompt} prompt tokens, max_tokens 1: prompt tokens/s")
    for mode, runs in values.items():
        ratio = sum(runs) / sum(values["no scores"])
        print(f"{mode:18} {base.fmt(runs, '.0f')}   {ratio:.3f}x no scores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
