"""vLLM's offline engine on the workload of `gpu_grammar.py`, the same-command reference of issue
45 (Llama-3-8B shape, random bf16 weights, one GPU): 256 concurrent requests of 512 random prompt
tokens and at most 128 output tokens, greedy, unconstrained against constrained by
`grammar_workload.ORDER_SCHEMA` through vLLM's structured outputs with its default backend
(`auto`, which picks xgrammar for this schema); output tokens/s of each, and their ratio.

Each mode runs once untimed, then twice in the order a, b, a, b; new prompts every run. vLLM reads
no weights (`load_format="dummy"`), but structured outputs need a tokenizer: the 128,256-token
Llama-3-like one of bench/studies/grammar (its `--tokenizer` folder, copied next to the config).
A constrained answer ends where the schema does (or at 128 tokens), so tokens/s counts the tokens
each answer got. The unconstrained runs use `ignore_eos` (the config names no end-of-sequence
token either way).

Run on the lent GPU once vLLM 0.26 is installed in /tmp/vsite (the device bundle), in the same
command as `gpu_grammar.py`:
  PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 \
      python3 bench/engine/vllm_grammar.py --tokenizer build/gtok/llama3-like
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

CONFIG_DIR = Path("/tmp/llama3-8b-grammar")


def write_model_dir(tokenizer: Path) -> None:
    import gpu_llama3_8b as base  # the same shape as kvrail's runs

    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    config = {**base.LLAMA3_8B, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "bfloat16", "eos_token_id": None}  # fmt: skip
    (CONFIG_DIR / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, CONFIG_DIR / name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", type=Path, required=True)
    args = parser.parse_args()
    write_model_dir(args.tokenizer)
    import grammar_workload
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=str(CONFIG_DIR), load_format="dummy", dtype="bfloat16", max_model_len=9216,
              seed=0)  # fmt: skip
    rng = random.Random(1)

    def prompts(n: int, length: int = 512) -> list[Any]:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(3, 120000) for _ in range(length)])
                for _ in range(n)]  # fmt: skip

    def run(params: Any) -> tuple[float, int]:
        batch = prompts(256)
        started = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return tokens / elapsed, tokens

    greedy = dict(max_tokens=128, temperature=0.0, detokenize=False)
    schema = StructuredOutputsParams(json=grammar_workload.ORDER_SCHEMA)
    modes = {
        "none": SamplingParams(**greedy, ignore_eos=True),
        "json_schema": SamplingParams(**greedy, structured_outputs=schema),
    }
    for params in modes.values():
        run(params)
    values: dict[str, list[tuple[float, int]]] = {name: [] for name in modes}
    for _ in range(2):
        for name, params in modes.items():
            values[name].append(run(params))
    print("\n## vLLM: 256 requests of 512 prompt / <= 128 output tokens: output tokens/s, twice")
    first = sum(v for v, _ in values["none"])
    for name, runs in values.items():
        ratio = sum(v for v, _ in runs) / first
        print(f"{name:12} " + " ".join(f"{v:10.0f} ({t} tokens)" for v, t in runs)
              + f"   {ratio:.3f}x none")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
