"""How fast can 256 requests of 512 prompt / 128 output tokens be on this GPU in bf16, at best?

    python3 -P bench/studies/gemm/flops_ceiling.py | tee bench/studies/gemm/flops_ceiling.txt

Counts the floating-point work of gpu_llama3_8b.py's 256-request case on the Llama-3-8B shape
(every projection of every prompt and generated token, the LM head of every sampled token, causal
attention) and the KV bytes its decode steps read, then times cuBLAS bf16 matmuls on the GPU (the
four projections of a 16,384-token prefill step, the same at 256 rows, i.e. a decode step of 256
requests, and an 8,192-cubed square) and a 1 GiB device copy. Three lower bounds on the wall time:

- any implementation on these matmuls: every FLOP at the best rate measured, with the memory
  traffic fully hidden under it (no attention reads, norms, sampling or host time counted);
- cuBLAS's GEMMs: each projection at the better of cuBLAS's two rates for its weight, the LM
  head and attention FLOPs at the best rate, traffic still hidden (say, by overlapping two
  batches' attention and GEMMs);
- this engine's design (layers in order, one batch at a time): the same, plus the decode steps'
  KV reads at the copy bandwidth (bandwidth-bound kernels that run between the GEMMs, not under
  them).

The issue's target of 10,000 output tokens/s needs it all done in 256 * 128 / 10,000 = 3.28 s.
Without a GPU it prints the counts only.
"""

from __future__ import annotations

import torch

LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
PROJECTIONS = {  # name: (in, out) of each layer's matmuls
    "qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    "o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTER),
    "down": (INTER, HIDDEN),
}


def kv_bytes(requests: int, prompt: int, output: int) -> float:
    """KV bytes the decode steps read (bf16): every step reads each request's whole context."""
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    return per_token * requests * sum(prompt + i for i in range(1, output))


def work(requests: int, prompt: int, output: int) -> dict[str, float]:
    """FLOPs (a multiply-add counts 2) of `requests` prompts of `prompt` tokens, each generating
    `output` tokens (the first from the prefill, the rest from decode steps)."""
    per_token = 2 * LAYERS * sum(i * o for i, o in PROJECTIONS.values())
    decode_tokens = requests * (output - 1)
    lm_head = 2 * HIDDEN * VOCAB * requests * output  # one row per sampled token
    # causal attention: QK^T and PV, 2 * 2 FLOPs per head dim per context position
    attention_unit = 4 * HEADS * HEAD_DIM * LAYERS
    prefill_ctx = prompt * (prompt + 1) / 2  # positions seen, summed over a prompt's tokens
    decode_ctx = sum(prompt + i for i in range(1, output))
    return {
        "projections, prompts": per_token * requests * prompt,
        "projections, generated": per_token * decode_tokens,
        "LM head": lm_head,
        "attention": attention_unit * requests * (prefill_ctx + decode_ctx),
    }


def tflops(m: int, k: int, n: int) -> float:
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        torch.nn.functional.linear(a, b)
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            torch.nn.functional.linear(a, b)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / 10)
    return 2 * m * k * n / best / 1e12


def main() -> int:
    requests, prompt, output = 256, 512, 128
    parts = work(requests, prompt, output)
    total = sum(parts.values())
    kv = kv_bytes(requests, prompt, output)
    print(f"# work of {requests} requests x {prompt} prompt / {output} output, Llama-3-8B shape")
    for name, value in parts.items():
        print(f"{name:24s} {value / 1e15:7.3f} PFLOP")
    print(f"{'total':24s} {total / 1e15:7.3f} PFLOP")
    print(f"{'KV read by decode steps':24s} {kv / 1e9:7.1f} GB")
    seconds = requests * output / 10_000
    print(f"10,000 tok/s allows {seconds:.3f} s: {total / seconds / 1e12:.0f} TFLOP/s sustained")
    if not torch.cuda.is_available():
        return 0
    print(f"\n# cuBLAS bf16 matmul on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rates: dict[tuple[str, int], float] = {}
    for rows in (16384, 256):
        for name, (k, n) in PROJECTIONS.items():
            rates[name, rows] = tflops(rows, k, n)
            print(f"{name:8s} M={rows:5d} K={k:5d} N={n:5d}  {rates[name, rows]:6.0f} TFLOP/s")
    square = tflops(8192, 8192, 8192)
    print(f"square   M=N=K=8192              {square:6.0f} TFLOP/s")
    bandwidth = copy_bandwidth()
    print(f"device copy of 1 GiB             {bandwidth / 1e12:6.2f} TB/s")
    best = max(*rates.values(), square)
    floor = total / best / 1e12
    print(
        f"\nany implementation, every FLOP at {best:.0f} TFLOP/s, traffic hidden: at least "
        f"{floor:.3f} s, at most {requests * output / floor:,.0f} output tok/s"
    )
    # every token's projections at the better of the shape's two rates (a few decode rows do
    # ride in prefill steps), so this stays a lower bound
    tokens = requests * (prompt + output - 1)
    design = sum(
        2 * LAYERS * k * n * tokens / (max(rates[name, 16384], rates[name, 256]) * 1e12)
        for name, (k, n) in PROJECTIONS.items()
    )
    design += (parts["LM head"] + parts["attention"]) / (best * 1e12)
    print(
        f"per-shape cuBLAS rates, traffic hidden: at least {design:.3f} s, at most "
        f"{requests * output / design:,.0f} output tok/s"
    )
    design += kv / bandwidth
    print(
        f"this design, per-shape cuBLAS rates, decode KV reads at {bandwidth / 1e12:.2f} TB/s: "
        f"at least {design:.3f} s, at most {requests * output / design:,.0f} output tok/s"
    )
    return 0


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * 2**30 * 10 / (start.elapsed_time(end) / 1e3)


if __name__ == "__main__":
    raise SystemExit(main())
