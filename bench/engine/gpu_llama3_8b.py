"""kvrail engine vs transformers on a Llama-3-8B-shaped model (random weights, bf16, one GPU).

Both use the same random weights (transformers initialises them, kvrail loads its state dict).

1. correctness: greedy tokens of kvrail vs transformers `generate` for a few prompts, 64 tokens
   each; prints where bf16 first diverges (if it does) for eager and CUDA-graph decode;
2. batch-1 decode tokens/s (prompt 128, 256 new tokens), decode phase only for kvrail;
3. 32 concurrent requests of 512 prompt / 128 output tokens: output tokens/s, wall clock;
4. 256 concurrent requests of 512 / 128 (kvrail only; transformers shown for 32);
5. prefill of 8,192 tokens: seconds to the first token (median of three prompts).

Targets (issue 3): (2) >= 200 tok/s, (3) >= 4,000 tok/s, (4) >= 10,000 tok/s, (5) <= 0.27 s;
bandwidth ceiling at batch 1 about 265 tok/s (16 GB of weights at 4.27 TB/s).

(2)-(4) run the same engine twice in the order async, sync, async, sync: with async scheduling
(the default on CUDA: each step queued before the previous one finished) and without it, as a
same-run baseline; each row gives both runs. (3) and (4) also split the wall clock at the moment
the last request got its first token: the prefill phase (every prompt computed, with the
decodes of requests already started) and the decode phase after it.

With `--quantization fp8` and/or `--kv-dtype float8_e4m3fn` the engine measured runs FP8
weights (quantized at load, a scale per row) and/or an FP8 KV cache; `--baseline bf16` makes the
same-run baseline the bf16 engine (unquantized weights, bf16 cache) over the same weights, and
the correctness part then prints, for the FP8 engine against the bf16 one, the logit error of a
prefill step and of a decode step and the first greedy divergence per prompt.

With `--baseline no-pdl` the same-run baseline is instead a second engine whose kernels launch
without programmatic dependent launch (KVRAIL_PDL=0: cuBLAS for every projection and no overlap
between kernels; kvrail.kernels.launch), both with async scheduling. With `--baseline
budget-8192` it is a second engine whose step token budget (max_num_batched_tokens) is 8,192,
against the one `--max-batched-tokens` sets (default 8,192) for the first. With `--baseline
no-mixed-graphs` it is a second engine that captures no mixed graphs (max_mixed_graph_tokens=0:
every step with prefill tokens runs eagerly, kvrail.worker.engine.cuda_graph).

Run on the H200:
  .venv/bin/python -P bench/engine/gpu_llama3_8b.py | tee bench/engine/gpu_llama3_8b.txt
Flags: --baseline {sync,no-pdl,budget-8192,bf16,no-mixed-graphs}, --quantization, --kv-dtype,
--max-batched-tokens, --skip-transformers, --skip-correctness, --correctness-only, --kv-gib (KV
pool size), --no-cuda-graphs, --smoke (a tiny config on CPU with short runs: checks this script
end to end without a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

LLAMA3_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192 + 1024,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


DEVICE = "cuda"
SMOKE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    sync()
    started = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - started


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    high = 120000 if DEVICE == "cuda" else SMOKE["vocab_size"]
    return torch.randint(3, high, (n, length), generator=g).tolist()


QUANTIZATION = "none"  # the measured engine's weights and KV dtype (--quantization, --kv-dtype)
KV_DTYPE = "auto"


def build_engine(
    hf: Any,
    config: Any,
    kv_gib: float,
    graphs: bool,
    quantization: str | None = None,
    dequantized: bool = False,
    tokenizer: Any = None,
    eos_token_id: int | None = None,
    **overrides: Any,
) -> Any:
    """A kvrail engine over `hf`'s weights; `quantization` and the `kv_dtype` override default
    to the measured engine's (QUANTIZATION, KV_DTYPE). With `dequantized` the decoder's
    projection weights are first rounded as FP8 quantization rounds them (a scale per row) and
    kept in the model's dtype: what FP8 weights compute, without FP8 kernels or activations."""
    from kvrail.worker.engine.config import EngineConfig, kv_cache_dtype
    from kvrail.worker.engine.engine import LLMEngine, make_fingerprint
    from kvrail.worker.kv_cache import KVCache
    from kvrail.worker.models.llama import LlamaForCausalLM

    dtype = next(hf.parameters()).dtype
    quantization = quantization or QUANTIZATION
    overrides.setdefault("kv_dtype", KV_DTYPE)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEVICE):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if quantization == "fp8":  # as LlamaForCausalLM.build does, on the GPU (the weights are)
        for module in model.projections():
            module.to_fp8_()
    state = hf.state_dict()
    if dequantized:
        from kvrail.kernels.reference import quantize_fp8_rows

        projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        for key, value in list(state.items()):
            if key.endswith(".weight") and key.split(".")[-2] in projections:
                values, scales = quantize_fp8_rows(value)
                state[key] = (values.float() * scales[:, None]).to(value.dtype)
    model.load_weights(state)
    shape = model.shape
    num_blocks = KVCache.num_blocks_for_bytes(
        int(kv_gib * 2**30),
        shape.num_layers,
        16,
        shape.num_kv_heads,
        shape.head_dim,
        kv_cache_dtype(overrides["kv_dtype"], dtype, DEVICE),
    )
    values: dict[str, Any] = {
        "num_blocks": num_blocks,
        "max_model_len": 8192 + 1024,
        "block_size": 16,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 256,
        "enable_cuda_graphs": graphs,
    }
    values.update(overrides)
    engine_config = EngineConfig(**values)
    fingerprint = make_fingerprint(model, engine_config, "random-llama3-8b", "none")
    print(
        f"# engine: weights {fingerprint.quantization}, KV {fingerprint.kv_dtype}, "
        f"{num_blocks} blocks"
    )
    return LLMEngine(model, engine_config, fingerprint, tokenizer, eos_token_id)


def warmed(engine: Any) -> Any:
    """`engine` after one short untimed run (compiles, CUDA-graph capture, allocator)."""
    from kvrail.sampling import SamplingParams

    engine.generate(prompts(4, 64, 9), SamplingParams(max_tokens=8, ignore_eos=True))
    return engine


def random_model(smoke: bool) -> tuple[Any, Any]:
    """(transformers model, its config): this shape with random weights, seeded (bf16 on the
    GPU; `smoke`: the tiny config in float32 on the CPU); prints the device first."""
    global DEVICE
    if smoke:
        DEVICE = "cpu"
        LLAMA3_8B.update(SMOKE)
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA3_8B)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    with torch.device(DEVICE):
        hf: Any = HFLlama(config).eval()
    torch.set_default_dtype(previous)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU smoke run"
    print(f"# {name}, torch {torch.__version__}")
    return hf, config


def bench_engine(smoke: bool, kv_gib: float, **overrides: Any) -> Any:
    """The measured engine of a script beside this one (`gpu_logprobs.py`, `gpu_choices.py`,
    `gpu_grammar.py`): `random_model`'s weights, CUDA graphs on a GPU, warmed, and what was
    built by then frozen out of the collector's sight, as the worker's main does. Unfrozen
    (about 490,000 tracked objects), a full collection stalled the engine about 210 ms, 4% of a
    5 s run of 256 x 512/128 on the H100, in whichever timed run it fell (issue 46: it made
    logprobs=5 look 0.94x; gpu_logprobs.txt).
    `overrides` go to `build_engine` (a tokenizer, EngineConfig fields)."""
    hf, config = random_model(smoke)
    kv_gib = 0.05 if smoke else kv_gib
    engine = warmed(build_engine(hf, config, kv_gib, DEVICE == "cuda", **overrides))
    gc.collect()
    gc.freeze()
    return engine


def alternate(modes: dict[str, bool], measure: Callable[[str], float]) -> dict[str, list[float]]:
    """Measure each mode twice, in the order a, b, a, b (these machines drift), after one
    untimed run of each (it pays for compiles and kernel plans of new shapes)."""
    for name in modes:
        measure(name)
    values: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(2):
        for name in modes:
            values[name].append(measure(name))
    return values


def fmt(values: list[float], spec: str) -> str:
    return " ".join(f"{v:10{spec}}" for v in values)


def generate_phases(engine: Any, batch: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """Run `batch` to completion; returns (seconds until every request had its first token,
    seconds in all)."""
    from kvrail.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sync()
    started = time.perf_counter()
    requests = [engine.add_request(f"p{started}-{i}", p, params) for i, p in enumerate(batch)]
    first = None
    while engine.has_unfinished_requests():
        engine.step()
        if first is None and all(r.num_output_tokens for r in requests):
            first = time.perf_counter() - started
    sync()
    total = time.perf_counter() - started
    assert all(r.num_output_tokens == max_tokens for r in requests)
    return first or total, total


@contextlib.contextmanager
def _no_pdl() -> Any:
    os.environ["KVRAIL_PDL"] = "0"
    try:
        yield
    finally:
        os.environ.pop("KVRAIL_PDL", None)


def step_logits(engine: Any, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 logits of `prompt`'s prefill step (its last position) and of the decode step
    after it, fed the bf16-greedy-independent token 11 so both engines decode the same input."""
    from kvrail.sampling import SamplingParams

    scheduler, runner = engine.scheduler, engine.runner
    request_id = f"logits-{time.perf_counter()}"
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=2))
    out = scheduler.schedule()
    prefill, _, _ = runner.execute(out)
    scheduler.update_from_output(out, {request_id: 11})
    out = scheduler.schedule()
    decode, _, _ = runner.execute(out)
    scheduler.update_from_output(out, {request_id: 12})
    assert not engine.has_unfinished_requests()
    return prefill[0].float(), decode[0].float()


def logit_error(ours: torch.Tensor, base: torch.Tensor) -> str:
    rel = float((ours - base).norm() / base.norm())
    top = int(ours.argmax()) == int(base.argmax())
    return (
        f"relative L2 {rel:.4f}, max abs {float((ours - base).abs().max()):.4f}, top-1 equal {top}"
    )


def first_divergence(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"token {i}"
    return "none" if len(a) == len(b) else f"length {min(len(a), len(b))}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--kv-gib", type=float, default=40.0)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--baseline",
        choices=("sync", "no-pdl", "budget-8192", "bf16", "no-mixed-graphs"),
        default="sync",
    )
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none")
    parser.add_argument("--kv-dtype", default="auto", help="the measured engine's KV dtype")
    parser.add_argument("--correctness-only", action="store_true", help="stop before timing")
    parser.add_argument("--prefill-only", action="store_true", help="time the 8k prefill alone")
    parser.add_argument(
        "--correctness-lengths", default="17,100,333,512",
        help="prompt lengths of the correctness part (from 4,096 on a prefill of the FP8 engine "
        "attends in FP8)",
    )  # fmt: skip
    parser.add_argument("--max-batched-tokens", type=int, default=8192, help="step token budget")
    args = parser.parse_args()
    global DEVICE, QUANTIZATION, KV_DTYPE
    QUANTIZATION, KV_DTYPE = args.quantization, args.kv_dtype
    if args.smoke:
        DEVICE = "cpu"
        LLAMA3_8B.update(SMOKE)
        args.kv_gib = 0.05
        args.no_cuda_graphs = True
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from kvrail.sampling import SamplingParams

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA3_8B)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    with torch.device(DEVICE):
        hf: Any = HFLlama(config)
        hf.eval()
    torch.set_default_dtype(previous)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU smoke run"
    print(f"# {name}, torch {torch.__version__}, step token budget {args.max_batched_tokens}")
    greedy = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}

    def hf_generate(batch: list[list[int]], new: int) -> Any:
        with torch.inference_mode():
            ids = torch.tensor(batch, device=DEVICE)
            return hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **greedy)

    graphs = not args.no_cuda_graphs
    budget = {"max_num_batched_tokens": args.max_batched_tokens}
    engine = warmed(build_engine(hf, config, args.kv_gib, graphs, **budget))

    bf16_engine = None
    if args.baseline == "bf16":
        bf16_engine = warmed(
            build_engine(hf, config, args.kv_gib, graphs, "none", kv_dtype="auto", **budget)
        )
    if not args.skip_correctness and bf16_engine is not None:
        # the bf16 engine over FP8-rounded weights separates what the rounding of the weights
        # changes (rounded vs bf16) from what the FP8 kernels, activations and cache add
        rounded = build_engine(
            hf, config, 4.0, graphs, "none", dequantized=True, kv_dtype="auto", **budget
        )
        lengths = [int(n) for n in args.correctness_lengths.split(",")]
        for i, prompt in enumerate(prompts(1, max(lengths), 1)[0][:n] for n in lengths):
            ours = step_logits(engine, prompt)
            base = step_logits(bf16_engine, prompt)
            same_weights = step_logits(rounded, prompt)
            for j, step in enumerate(("prefill", "decode")):
                print(
                    f"logits prompt={i} len={len(prompt)} {step:7s} fp8 vs bf16: "
                    f"{logit_error(ours[j], base[j])}; fp8 vs rounded weights in bf16: "
                    f"{logit_error(ours[j], same_weights[j])}; rounded vs bf16: "
                    f"{logit_error(same_weights[j], base[j])}"
                )
            params = SamplingParams(max_tokens=64, ignore_eos=True)
            tokens = [e.generate([prompt], params)[0] for e in (engine, bf16_engine, rounded)]
            print(
                f"correctness prompt={i} len={len(prompt)} first divergence: fp8 vs bf16 "
                f"{first_divergence(tokens[0], tokens[1])}, fp8 vs rounded weights in bf16 "
                f"{first_divergence(tokens[0], tokens[2])}, rounded vs bf16 "
                f"{first_divergence(tokens[2], tokens[1])}"
            )
        del rounded
        gc.collect()
        torch.cuda.empty_cache()
    elif not args.skip_correctness:
        # Each engine sees the same prompts in the same order, so the same prefix-cache hits.
        eager = build_engine(hf, config, 8.0, graphs=False, **budget)
        synchronous = build_engine(hf, config, 8.0, graphs, **budget)
        synchronous.pipeline.async_scheduling = False
        for i, prompt in enumerate(prompts(1, 512, 1)[0][:n] for n in (17, 100, 333, 512)):
            expected = hf_generate([prompt], 64)[0, len(prompt) :].tolist()
            params = SamplingParams(max_tokens=64, ignore_eos=True)
            ours = engine.generate([prompt], params)[0]
            ours_eager = eager.generate([prompt], params)[0]
            ours_sync = synchronous.generate([prompt], params)[0]
            print(
                f"correctness prompt={i} len={len(prompt)} first divergence vs transformers: "
                f"graphs={first_divergence(ours, expected)} "
                f"eager={first_divergence(ours_eager, expected)} "
                f"graphs-vs-eager={first_divergence(ours, ours_eager)} "
                f"async-vs-sync={first_divergence(ours, ours_sync)}"
            )
        del eager, synchronous
        gc.collect()
        torch.cuda.empty_cache()

    if args.correctness_only:
        return 0
    print("benchmark                     impl          value")
    if args.baseline == "sync":
        modes = {"kvrail": True, "kvrail sync": False}
        engines = {"kvrail": engine, "kvrail sync": engine}
    elif args.baseline == "no-pdl":
        modes = {"kvrail": True, "kvrail no-PDL": True}
        with _no_pdl():
            baseline = warmed(build_engine(hf, config, args.kv_gib, graphs, **budget))
        engines = {"kvrail": engine, "kvrail no-PDL": baseline}
    elif args.baseline == "bf16":
        modes = {"kvrail": True, "kvrail bf16": True}
        engines = {"kvrail": engine, "kvrail bf16": bf16_engine}
    elif args.baseline == "no-mixed-graphs":
        modes = {"kvrail": True, "kvrail eager-mixed": True}
        baseline = warmed(
            build_engine(hf, config, args.kv_gib, graphs, max_mixed_graph_tokens=0, **budget)
        )
        engines = {"kvrail": engine, "kvrail eager-mixed": baseline}
    else:
        modes = {"kvrail": True, "kvrail b8192": True}
        baseline = warmed(
            build_engine(hf, config, args.kv_gib, graphs, max_num_batched_tokens=8192)
        )
        engines = {"kvrail": engine, "kvrail b8192": baseline}

    def use(name: str) -> Any:
        """The engine of mode `name`, with the environment its eager launches need."""
        if name.endswith("no-PDL"):
            os.environ["KVRAIL_PDL"] = "0"
        else:
            os.environ.pop("KVRAIL_PDL", None)
        chosen = engines[name]
        chosen.pipeline.async_scheduling = modes[name]
        return chosen

    batch1_runs = iter(range(100))

    def batch1(name: str) -> float:
        engine = use(name)
        prompt = prompts(1, 128, 2)[0]
        params = SamplingParams(max_tokens=257, ignore_eos=True)
        request = engine.add_request(f"b1-{next(batch1_runs)}", prompt, params)
        engine.step()  # prefill -> first token, on the host
        # No sync before the clock starts: with async scheduling the second step is already
        # queued, and waiting for it here would leave its time out of the 256 steps timed.
        started = time.perf_counter()
        for _ in range(256):
            engine.step()
        sync()
        seconds = time.perf_counter() - started
        assert request.num_output_tokens == 257 and not engine.has_unfinished_requests()
        return 256 / seconds

    if not args.prefill_only:
        decode_benchmarks(args, modes, batch1, use, hf_generate)
    prefill_benchmark(args, use, hf)
    return 0


def decode_benchmarks(args: Any, modes: Any, batch1: Any, use: Any, hf_generate: Any) -> None:
    """2. batch-1 decode; 3./4. 32 and 256 concurrent requests."""

    # 2. batch-1 decode: time per decode step after the first token.
    result = alternate(modes, batch1)
    for name, values in result.items():
        print(f"batch-1 decode tok/s          {name:13s} {fmt(values, '.1f')}")
    prompt = prompts(1, 128, 2)[0]
    if not args.skip_transformers:
        hf_generate([prompt], 8)
        _, hf_s = timed(lambda: hf_generate([prompt], 257))
        _, hf_prefill = timed(lambda: hf_generate([prompt], 1))
        print(f"batch-1 decode tok/s          transformers  {256 / (hf_s - hf_prefill):10.1f}")

    # 3./4. concurrent requests, 512 prompt / 128 output tokens, wall clock incl. prefill.
    for n in (32, 256) if DEVICE == "cuda" else (4, 8):
        phases: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
        seeds = iter(range(1000 * n, 1000 * n + 10))

        def concurrent(name: str, n: int = n, phases: Any = phases, seeds: Any = seeds) -> float:
            engine = use(name)
            # new prompts every run: a prompt seen before would hit the prefix cache
            first, total = generate_phases(engine, prompts(n, 512, next(seeds)), 128)
            phases[name].append((first, total - first))
            del phases[name][:-2]  # the untimed first run
            return n * 128 / total

        result = alternate(modes, concurrent)
        for name, values in result.items():
            print(f"{n:3d} x 512/128 output tok/s    {name:13s} {fmt(values, '.1f')}")
        for name, split in phases.items():
            pre = fmt([p for p, _ in split], ".3f")
            dec = fmt([d for _, d in split], ".3f")
            print(f"{n:3d} x 512/128 prefill phase s {name:13s} {pre}")
            print(f"{n:3d} x 512/128 decode phase s  {name:13s} {dec}")
        if n == 32 and not args.skip_transformers:
            _, hf_s = timed(partial(hf_generate, prompts(n, 512, 3 + n), 128))
            print(f"{n:3d} x 512/128 output tok/s    transformers  {n * 128 / hf_s:10.1f}")


def prefill_benchmark(args: Any, use: Any, hf: Any) -> None:
    """5. prefill of 8,192 tokens to the first token: the median of three prompts (each new,
    so no prefix-cache hit), for kvrail and transformers alike."""
    from kvrail.sampling import SamplingParams

    engine = use("kvrail")
    length = 8192 if DEVICE == "cuda" else 600
    warm = prompts(1, 1024, 5)[0]  # not a prefix of the timed prompts
    engine.generate([warm], SamplingParams(max_tokens=1))
    ours = [
        timed(lambda p=p: engine.generate([p], SamplingParams(max_tokens=1)))[1]
        for p in (prompts(1, length, seed)[0] for seed in (4, 6, 7))
    ]
    print(
        f"prefill 8192 tokens seconds   kvrail        {sorted(ours)[1]:10.3f}"
        f"  (runs {fmt(ours, '.3f')})"
    )
    if not args.skip_transformers:
        theirs = []
        with torch.inference_mode():
            hf(torch.tensor([warm], device=DEVICE), logits_to_keep=1)
            for seed in (4, 6, 7):
                ids = torch.tensor(prompts(1, length, seed), device=DEVICE)
                theirs.append(timed(lambda ids=ids: hf(ids, logits_to_keep=1))[1])
        print(
            f"prefill 8192 tokens seconds   transformers  {sorted(theirs)[1]:10.3f}"
            f"  (runs {fmt(theirs, '.3f')})"
        )


if __name__ == "__main__":
    raise SystemExit(main())
