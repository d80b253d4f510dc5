"""Where does an engine step spend its time on the GPU? (diagnostics for bench/engine tuning)

    python3 -P bench/studies/profile/profile_gpu.py [--layers 32] [--batches 1 32] [--prefill]
                                           [--max-batched-tokens N]
                                           [--quantization fp8] [--kv-dtype float8_e4m3fn]
                                           [--mixed 0 1 3]

Builds the Llama-3-8B-shaped engine of gpu_llama3_8b.py (random bf16 weights), then for decode
batches of 1 and 32 (or --batches): wall time per step, GPU time per step (CUDA events around
the model call), and a torch.profiler table of the top CUDA kernels and CPU ops over 20 steps.
Also prints the logit difference to transformers on the first step (relative to the logits'
spread), which tells bf16 noise from a real error when greedy tokens diverge.

With --prefill it profiles prefills instead: 32 prompts of 512 tokens (the prefill phase of
gpu_llama3_8b.py's 32-request case, in steps of the engine's token budget) and one of 8,192.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine"))  # gpu_llama3_8b
import gpu_llama3_8b as base

from kvrail.sampling import SamplingParams


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prefill", action="store_true", help="profile prefills, not decode steps")
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--mixed", type=int, nargs="*", metavar="PROMPTS_PER_STEP",
                   help="profile mixed steps: 64 decodes plus this many new 600-token prompts "
                   "per step (e.g. --mixed 0 1 3; 0: decode only)")  # fmt: skip
    p.add_argument("--quantization", choices=("none", "fp8"), default="none")
    p.add_argument("--kv-dtype", default="auto", help="e.g. float8_e4m3fn")
    args = p.parse_args()
    base.QUANTIZATION, base.KV_DTYPE = args.quantization, args.kv_dtype
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    base.LLAMA3_8B["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    config = LlamaConfig(**base.LLAMA3_8B)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = HFLlama(config).eval()
    torch.set_default_dtype(torch.float32)
    engine = base.build_engine(
        hf, config, 30.0, graphs=True, max_num_batched_tokens=args.max_batched_tokens
    )
    prompt = base.prompts(1, 128, 2)[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    # logits of our model on the same prompt (eager forward through the engine's model)
    try:
        ours = _first_logits(engine, prompt)
        diff = (ours - ref).abs()
        print(
            f"first-step logits: max|diff|={diff.max():.4f} mean|diff|={diff.mean():.5f} "
            f"logit std={ref.std():.4f} top2 gap={_gap(ref):.4f} argmax equal="
            f"{int(ours.argmax()) == int(ref.argmax())}"
        )
    except Exception as err:
        print("logit comparison unavailable:", type(err).__name__, err)

    if args.prefill:
        return _profile_prefills(engine)
    if args.mixed is not None:
        return _profile_mixed(engine, args.mixed)

    from torch.profiler import ProfilerActivity, profile

    for bs in args.batches:
        batch = base.prompts(bs, 512, 7 + bs)
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        requests = [engine.add_request(f"p{bs}-{i}", pr, params) for i, pr in enumerate(batch)]
        while not all(r.num_output_tokens for r in requests):
            engine.step()  # prefill (several steps when the prompts exceed the token budget)
        for _ in range(10):
            engine.step()
        # No sync before the clock starts: with async scheduling the next step is already
        # queued, and waiting for it here would leave one of the timed steps out.
        t0 = time.perf_counter()
        for _ in range(50):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 50
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                engine.step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_total = sum(e.self_device_time_total for e in events) / 20 / 1e3
        print(
            f"\n=== batch {bs}: wall {wall * 1e3:.2f} ms/step, GPU busy {gpu_total:.2f} ms/step,"
            f" {bs / wall:.0f} tok/s"
        )
        print(
            events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60)
        )
        print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
        print(_idle(prof, steps=20))
        while engine.has_unfinished_requests():
            engine.step()
    return 0


def _idle(prof, steps: int) -> str:  # type: ignore[no-untyped-def]
    """How long the GPU ran no kernel between the profile's first kernel and its last: the
    union of the kernels' intervals (under PDL they overlap) against that window, per step,
    and the longest gaps with the kernels on either side."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    )
    if not kernels:
        return "idle: no kernels recorded"
    gaps, end, before = [], kernels[0][1], kernels[0][2]
    for start, stop, name in kernels[1:]:
        if start > end:
            gaps.append((start - end, before, name))
        if stop > end:
            end, before = stop, name
    window = end - kernels[0][0]
    idle = sum(g for g, _, _ in gaps)
    lines = [
        f"GPU idle: {idle / steps:.1f} us per step of {window / steps:.1f} us "
        f"({idle / window:.1%}), {len(gaps)} gaps, the longest:"
    ]
    for gap, a, b in sorted(gaps, reverse=True)[:6]:
        lines.append(f"  {gap:8.1f} us  after {a[:50]}  before {b[:50]}")
    return "\n".join(lines)


def _profile_prefills(engine) -> int:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for name, n, length in (("32 x 512", 32, 512), ("1 x 8192", 1, 8192)):
        engine.generate(base.prompts(n, length, 50 + n), params)  # compiles, allocator warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(base.prompts(n, length, 60 + n), params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(base.prompts(n, length, 70 + n), params)
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_total = sum(e.self_device_time_total for e in events) / 1e3
        print(f"\n=== prefill {name}: wall {wall * 1e3:.1f} ms, GPU busy {gpu_total:.1f} ms")
        print(
            events.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=60)
        )
    return 0


def _profile_mixed(engine, per_step: list[int]) -> int:  # type: ignore[no-untyped-def]
    """A colocated worker's steps under chat load: 64 running decodes, and each step `k` new
    600-token prompts prefilled in the same step; each k replaying the mixed CUDA graphs, then
    eagerly (the graphs' token sizes hidden from the runner, which then chooses no mixed graph)."""
    from torch.profiler import ProfilerActivity, profile

    decode = SamplingParams(max_tokens=4000, ignore_eos=True)
    first = SamplingParams(max_tokens=2, ignore_eos=True)
    running = [engine.add_request(f"d{i}", pr, decode) for i, pr in
               enumerate(base.prompts(64, 600, 11))]  # fmt: skip
    while not all(r.num_output_tokens for r in running):
        engine.step()
    seed = [100]

    def steps(k: int, n: int) -> None:
        for _ in range(n):
            seed[0] += 1
            for j, pr in enumerate(base.prompts(k, 600, seed[0])):
                engine.add_request(f"m{seed[0]}-{j}", pr, first)
            engine.step()

    graphs = engine.runner.graphs
    sizes = graphs.token_sizes
    for mode in ("mixed graphs", "eager mixed steps"):
        graphs.token_sizes = sizes if mode == "mixed graphs" else []
        print(f"\n##### {mode} (largest mixed graph: {graphs.max_mixed_tokens} tokens)")
        for k in per_step:
            steps(k, 5)  # warm-up: compiles, allocator
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps(k, 20)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 20
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                steps(k, 10)
                torch.cuda.synchronize()
            events = prof.key_averages()
            gpu_total = sum(e.self_device_time_total for e in events) / 10 / 1e3
            print(f"\n=== 64 decodes + {k} x 600-token prompts per step: wall "
                  f"{wall * 1e3:.2f} ms/step, GPU busy {gpu_total:.2f} ms/step")  # fmt: skip
            if mode == "mixed graphs":
                print(events.table(sort_by="self_device_time_total", row_limit=12,
                                   max_name_column_width=60))  # fmt: skip
    graphs.token_sizes = sizes
    return 0


def _gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _first_logits(engine, prompt):  # type: ignore[no-untyped-def]
    """Our model's last-position logits for `prompt`, via the engine's own prefill path."""
    captured = {}
    runner = engine.runner
    original = runner._logits

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        out = original(*a, **k)
        captured["logits"] = out[0]
        return out

    runner._logits = spy
    try:
        engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        runner._logits = original
    return captured["logits"].reshape(-1, captured["logits"].shape[-1])[-1].float()


if __name__ == "__main__":
    raise SystemExit(main())
