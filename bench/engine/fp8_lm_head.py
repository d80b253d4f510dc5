"""What an FP8 LM head would cost: the real SmolLM2-135M-Instruct on CPU, in float32 through
transformers, its final hidden states over `data/kv_dtype_text.txt` (the first 640 tokens, scored
from token 16, as `fp8_accuracy.py`) multiplied by the LM head as it is, and by the LM head in
e4m3 with a scale per row over the hidden states quantized per token (what kvrail's FP8
projections do). Only the LM head changes; the decoder stays float32.

An FP8 LM head would halve the largest single read of a batch-1 decode step (1.05 of 8.03 GB on
a Llama-3-8B), about 0.12 of its 2.7 ms on an H200. kvrail keeps the LM head in the model's
dtype, as vLLM does and as FP8 checkpoints ship it; this is the measurement behind that.

    .venv/bin/python -P bench/engine/fp8_lm_head.py | tee bench/engine/fp8_lm_head.txt
"""

from __future__ import annotations

import math
import platform
from pathlib import Path

import torch
import transformers

from kvrail.kernels.reference import dequantize_rows, quantize_fp8_rows, quantize_rows
from kvrail.worker.models.loader import load

TEXT = Path(__file__).parent / "data" / "kv_dtype_text.txt"
TOKENS, START = 640, 16


def main() -> int:
    torch.set_num_threads(2)
    loaded = load("smollm2")
    ids = torch.tensor([loaded.tokenizer(TEXT.read_text()).input_ids[:TOKENS]])  # type: ignore[attr-defined]
    model = transformers.LlamaForCausalLM(loaded.config)
    model.load_state_dict({k: v.float() for k, v in loaded.state_dict.items()}, strict=False)
    model.tie_weights()  # SmolLM2's LM head is its embedding
    model.eval()
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state[0]
        weight = model.lm_head.weight.float()
        values, scales = quantize_fp8_rows(weight)
        exact = hidden @ weight.T
        fp8 = (
            dequantize_rows(quantize_rows(hidden, None)).float()
            @ (values.float() * scales[:, None]).T
        )

    def perplexity(logits: torch.Tensor) -> float:
        logprobs = torch.log_softmax(logits[START:-1], -1)
        return math.exp(-logprobs.gather(1, ids[0, START + 1 :, None]).mean().item())

    base, quantized = perplexity(exact), perplexity(fp8)
    agree = (exact[START:].argmax(-1) == fp8[START:].argmax(-1)).float().mean().item()
    rel = ((fp8 - exact).norm(dim=-1) / exact.norm(dim=-1)).mean().item()
    print(f"# bench/engine/fp8_lm_head.py, {platform.machine()}, torch {torch.__version__}")
    print(f"# {TEXT.name}, {TOKENS} tokens scored from {START}; the decoder in float32")
    print(f"perplexity, LM head float32      {base:8.4f}")
    print(
        f"perplexity, LM head e4m3 per row {quantized:8.4f}  ({(quantized / base - 1) * 100:+.2f}%)"
    )
    print(
        f"greedy token equal at {agree * 100:.1f}% of positions; logits' mean relative L2 {rel:.4f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
