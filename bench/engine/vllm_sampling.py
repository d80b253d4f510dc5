"""vLLM's offline engine on the workloads of `gpu_logprobs.py` and `gpu_choices.py`, for the
same-command reference of issue 46 (Llama-3-8B shape, random bf16 weights, one GPU).

1. 256 concurrent requests of 512 prompt / 128 output tokens, greedy, ignore_eos: output tokens/s
   without logprobs and with `logprobs=5`;
2. 8 choices over 32 prompts (`n=8`, seeded, temperature 1) against 256 prompts (`n=1`, seeded,
   temperature 1), 512 / 128 tokens per choice: output tokens/s.

Each mode runs once untimed, then twice in the order a, b, a, b; new prompts every run (random
token ids, so no prefix is shared between runs). vLLM reads no weights (`load_format="dummy"`)
and no tokenizer (token-id prompts).

Run on the lent GPU once vLLM 0.26 is installed in /tmp/vsite (the device bundle), in the same
command as the kvrail scripts:
  PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python3 bench/engine/vllm_sampling.py
`--prompt-len` and `--max-tokens` set the lengths (default 512 / 128), as in the kvrail scripts;
`--only logprobs` or `--only choices` runs one part.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

CONFIG_DIR = Path("/tmp/llama3-8b-sampling")


def write_config() -> None:
    import gpu_llama3_8b as base  # the same shape as kvrail's runs

    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    config = {**base.LLAMA3_8B, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "bfloat16", "eos_token_id": None}  # fmt: skip
    (CONFIG_DIR / "config.json").write_text(json.dumps(config))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--only", choices=("logprobs", "choices"), help="one of the two parts")
    args = parser.parse_args()
    length, out = args.prompt_len, args.max_tokens
    write_config()
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(CONFIG_DIR), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=9216, seed=0)  # fmt: skip
    rng = random.Random(1)

    def prompts(n: int) -> list[Any]:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(3, 120000) for _ in range(length)])
                for _ in range(n)]  # fmt: skip

    def run(n: int, params: Any) -> float:
        batch = prompts(n)
        started = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return tokens / elapsed

    def alternate(modes: dict[str, tuple[int, Any]]) -> dict[str, list[float]]:
        for n, params in modes.values():
            run(n, params)
        values: dict[str, list[float]] = {name: [] for name in modes}
        for _ in range(2):
            for name, (n, params) in modes.items():
                values[name].append(run(n, params))
        return values

    def report(title: str, values: dict[str, list[float]]) -> None:
        print(f"\n## vLLM: {title}: output tokens/s (two runs each)")
        first = next(iter(values))
        for name, runs in values.items():
            ratio = sum(runs) / sum(values[first])
            print(f"{name:18} " + " ".join(f"{v:10.0f}" for v in runs) + f"   {ratio:.3f}x {first}")

    greedy = dict(max_tokens=out, ignore_eos=True, temperature=0.0, detokenize=False)
    if args.only != "choices":
        report(f"256 requests of {length} / {out} tokens", alternate({
            "none": (256, SamplingParams(**greedy)),
            "logprobs=5": (256, SamplingParams(**greedy, logprobs=5)),
        }))  # fmt: skip
    sampled = dict(max_tokens=out, ignore_eos=True, temperature=1.0, detokenize=False, seed=7)
    if args.only != "logprobs":
        report(f"{length} prompt / {out} output tokens per choice", alternate({
            "256 prompts": (256, SamplingParams(**sampled)),
            "n=8 x 32 prompts": (32, SamplingParams(**sampled, n=8)),
        }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
