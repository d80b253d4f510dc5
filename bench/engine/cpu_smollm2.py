"""CPU throughput of the kvrail engine vs transformers on SmolLM2-135M-Instruct (float32).

Both generate `--output-tokens` greedy tokens (EOS ignored) for `--batch` prompts of
`--prompt-tokens` tokens. transformers runs one `generate` over the left-padded batch; kvrail runs
the same prompts through continuous batching. Reported: output tokens per second, wall time, and
whether the greedy tokens agree.

Run: .venv/bin/python -P bench/engine/cpu_smollm2.py --threads 2 | tee bench/engine/cpu_smollm2.txt
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    from kvrail.sampling import SamplingParams
    from kvrail.worker.models.loader import load, load_transformers_model
    from kvrail.worker.testing import make_engine

    loaded = load("smollm2")
    hf = load_transformers_model("smollm2")
    text = "The history of the river valley began long before the first written records. " * 20
    base = loaded.tokenizer(text).input_ids
    print(f"# {' '.join(sys.argv)}")
    print(
        f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"threads={args.threads}, cpus={os.cpu_count()}"
    )
    print("batch  impl          out_tok/s   seconds  same_tokens")
    for batch in args.batch:
        prompts = [base[i : i + args.prompt_tokens] for i in range(batch)]
        params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
        blocks = batch * (args.prompt_tokens + args.output_tokens) // 16 + batch + 8
        engine = make_engine(
            loaded.config,
            loaded.state_dict,
            num_blocks=blocks,
            block_size=16,
            max_num_batched_tokens=max(512, batch * args.prompt_tokens),
            max_model_len=2048,
        )
        engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
        started = time.perf_counter()
        ours = engine.generate(prompts, params)
        ours_s = time.perf_counter() - started

        pad = loaded.tokenizer.eos_token_id
        inputs = torch.tensor(prompts)  # equal lengths: no padding needed
        with torch.inference_mode():
            hf.generate(inputs[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=pad)
            started = time.perf_counter()
            out = hf.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=args.output_tokens,
                min_new_tokens=args.output_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            hf_s = time.perf_counter() - started
        theirs = out[:, args.prompt_tokens :].tolist()
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        total = batch * args.output_tokens
        print(f"{batch:5d}  kvrail        {total / ours_s:9.1f}  {ours_s:8.2f}  {same}/{batch}")
        print(f"{batch:5d}  transformers  {total / hf_s:9.1f}  {hf_s:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
