"""What FP8 costs in accuracy: the real SmolLM2-135M-Instruct on CPU (float32 compute, the torch
reference path), its weights as they are or in FP8 (e4m3, a scale per output row, quantized at
load, dynamic per-token activation scales) and its KV cache in float32, bfloat16,
float8_e4m3fn or float8_e5m2 (a scale of 1, saturating). The baseline is float32 throughout.

- Perplexity of `data/kv_dtype_text.txt` (its first `--tokens`), teacher-forced: token k is
  predicted by a request for the text's first k tokens, whose prefix comes from the prefix
  cache, so every prediction attends over K and V read back from the cache in its dtype (a whole
  prompt computed in one step would attend over its fresh, unrounded K and V and hide the
  cache's rounding).
- Greedy agreement with the baseline over a prompt set (chat-templated, 64 tokens each): how
  many outputs are equal, and the first diverging token of each that is not.

Reported, not asserted: tests pin the exact behaviour (tests/unit/worker/test_kv_dtype.py,
tests/unit/worker/test_fp8_weights.py).

Run: .venv/bin/python -P bench/engine/fp8_accuracy.py --threads 2 \
         | tee bench/engine/fp8_accuracy.txt
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

CONFIGS = (  # (weights, KV cache)
    ("none", "float32"),
    ("none", "bfloat16"),
    ("none", "float8_e4m3fn"),
    ("none", "float8_e5m2"),
    ("fp8", "float32"),
    ("fp8", "float8_e4m3fn"),
)
TEXT = Path(__file__).parent / "data" / "kv_dtype_text.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What are the three states of matter?",
    "Describe a lighthouse keeper's day.",
    "How do I sort a list in Python?",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=640, help="score the first N (0: all)")
    parser.add_argument("--context-start", type=int, default=16, help="first token scored")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    from kvrail.worker.models.loader import load

    loaded = load("smollm2")
    text = loaded.tokenizer(TEXT.read_text()).input_ids  # type: ignore[attr-defined]
    if args.tokens:
        text = text[: args.tokens]
    tokenizer = loaded.tokenizer
    chats = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        ).input_ids
        for p in PROMPTS
    ]
    print(f"# {' '.join(sys.argv)}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.threads} threads")  # fmt: skip
    print(f"# text: {TEXT.name}, {len(text)} tokens, scored from token {args.context_start}; "
          f"{len(chats)} chat prompts x {args.max_tokens} greedy tokens")  # fmt: skip
    print(f"{'weights':>7} {'kv_dtype':>14} {'KV bytes/token':>15} {'perplexity':>11} "
          f"{'vs base':>8} {'equal outputs':>14}  seconds  "
          "first divergences (prompt:token)")  # fmt: skip
    baseline_ppl: float | None = None
    baseline_out: list[list[int]] | None = None
    for quantization, kv_dtype in CONFIGS:
        started = time.perf_counter()
        engine = _engine(loaded, quantization, kv_dtype, len(text))
        ppl = _perplexity(engine, text, args.context_start)
        outputs = _greedy(engine, chats, args.max_tokens)
        baseline_ppl = baseline_ppl or ppl
        baseline_out = baseline_out or outputs
        divergences = [
            f"{p}:{_first_divergence(a, b)}"
            for p, (a, b) in enumerate(zip(baseline_out, outputs, strict=True))
            if a != b
        ]
        equal = sum(a == b for a, b in zip(baseline_out, outputs, strict=True))
        per_token = engine.kv_cache.block_bytes // engine.config.block_size
        print(f"{quantization:>7} {kv_dtype:>14} {per_token:>15,} {ppl:>11.4f} "
              f"{ppl / baseline_ppl - 1:>+8.2%} {equal:>7}/{len(chats):<6} "
              f"{time.perf_counter() - started:8.1f}  {' '.join(divergences) or '-'}")  # fmt: skip
    return 0


def _engine(loaded: object, quantization: str, kv_dtype: str, text_tokens: int) -> object:
    from kvrail.worker.engine.config import EngineConfig
    from kvrail.worker.engine.engine import LLMEngine

    block_size = 16
    config = EngineConfig(
        num_blocks=text_tokens // block_size + 64, block_size=block_size, max_model_len=2048,
        max_num_batched_tokens=2048, kv_dtype=kv_dtype,
    )  # fmt: skip
    return LLMEngine.from_loaded(loaded, config, quantization=quantization)  # type: ignore[arg-type]


def _perplexity(engine: object, text: list[int], start: int) -> float:
    """exp(mean NLL) of text[start:], each token predicted from the cached prefix before it."""
    from kvrail.sampling import SamplingParams

    scheduler, runner = engine.scheduler, engine.runner  # type: ignore[attr-defined]
    total = 0.0
    for k in range(start, len(text)):
        request_id = f"ppl-{k}"
        engine.add_request(request_id, text[:k], SamplingParams(max_tokens=1))  # type: ignore[attr-defined]
        out = scheduler.schedule()
        logits, _, _ = runner.execute(out)
        total -= float(torch.log_softmax(logits[0].float(), dim=-1)[text[k]])
        scheduler.update_from_output(out, {request_id: text[k]})
    return math.exp(total / (len(text) - start))


def _greedy(engine: object, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from kvrail.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return engine.generate(prompts, params)  # type: ignore[attr-defined,no-any-return]


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


if __name__ == "__main__":
    sys.exit(main())
