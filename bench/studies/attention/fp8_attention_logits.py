"""FP8 prefill attention on and off in the same FP8 engine (FP8 weights, e4m3 KV cache) on a
Llama-3-8B shape with random weights, beside the bf16 engine over the same weights: the logits of
a 4,096- and an 8,192-token prompt's prefill step and of the decode step after it, and where 64
greedy tokens first diverge. Prefix caching is off, so every run computes its prompt afresh
(the FP8 path takes fresh prompts only); `_FP8_ON_CUDA` is switched in the running process.

    python3 -P bench/studies/attention/fp8_attention_logits.py     # a lent H100 or H200
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine"))  # gpu_llama3_8b


def main() -> int:
    import gpu_llama3_8b as bench
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from kvrail.sampling import SamplingParams
    from kvrail.worker.layers import attention

    torch.manual_seed(0)
    config = LlamaConfig(**bench.LLAMA3_8B)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf: Any = HFLlama(config)
        hf.eval()
    torch.set_default_dtype(torch.float32)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    common = {"enable_prefix_caching": False}
    fp8 = bench.warmed(
        bench.build_engine(hf, config, 4.0, True, "fp8", kv_dtype="float8_e4m3fn", **common)
    )
    bf16 = bench.warmed(
        bench.build_engine(hf, config, 4.0, True, "none", kv_dtype="auto", **common)
    )
    del hf
    torch.cuda.empty_cache()
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for length in (4096, 8192):
        prompt = bench.prompts(1, length, 1)[0]
        logits, tokens = {}, {}
        for on in (True, False):
            attention._FP8_ON_CUDA = on
            logits[on] = bench.step_logits(fp8, prompt)
            tokens[on] = fp8.generate([prompt], params)[0]
        base, base_tokens = bench.step_logits(bf16, prompt), bf16.generate([prompt], params)[0]
        for j, step in enumerate(("prefill", "decode")):
            print(
                f"len={length} {step:7s} FP8 attention on vs off: "
                f"{bench.logit_error(logits[True][j], logits[False][j])}\n"
                f"{'':19s} on vs the bf16 engine:  {bench.logit_error(logits[True][j], base[j])}\n"
                f"{'':19s} off vs the bf16 engine: {bench.logit_error(logits[False][j], base[j])}"
            )
        print(
            f"len={length} 64 greedy tokens, first divergence: on vs off "
            f"{bench.first_divergence(tokens[True], tokens[False])}, on vs bf16 "
            f"{bench.first_divergence(tokens[True], base_tokens)}, off vs bf16 "
            f"{bench.first_divergence(tokens[False], base_tokens)}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
