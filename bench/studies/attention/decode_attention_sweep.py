"""Sweep the paged decode attention kernel's launch settings on the GPU (Llama-3-8B shapes).

    python3 -P bench/studies/attention/decode_attention_sweep.py \\
        | tee bench/studies/attention/decode_attention_sweep.txt
    python3 -P bench/studies/attention/decode_attention_sweep.py --kv-dtype float8_e4m3fn

For batches of 1, 32 and 256 sequences of 512-640 tokens (the decode steps of gpu_llama3_8b.py)
over the engine's KV layout (one layer's view of the whole-worker region, blocks scattered, in
bf16 or FP8), times every combination of split count, tile length, warps and pipeline stages,
replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`), and prints the default's time
and largest error against the float32 reference, the best five and the bytes per second each
reaches (K and V of every context token read once). `--max-registers 96 80` also times the
default launch with those caps on registers per thread (more programs per SM, some spills:
kernel_sass.py counts both without a GPU), each beside the default again.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from kvrail.kernels import decode_attention as dec
from kvrail.kernels import reference
from kvrail.worker.kv_cache import KVCache

LAYERS, HKV, HQ, D, BS = 32, 8, 32, 128, 16
TABLE_WIDTH = (8192 + 1024) // BS  # the captured graphs' width (max_model_len 9216)


def case(
    batch: int, generator: torch.Generator, kv_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, ...]:
    lens = torch.randint(512, 641, (batch,), generator=generator)
    need = int(((lens + BS - 1) // BS).sum())
    cache = KVCache.allocate(need + 1, LAYERS, BS, HKV, D, kv_dtype, "cuda")
    for block in cache.tensor:  # one block at a time: an FP8 cache cannot be filled in place
        block.copy_(torch.randn(block.shape, device="cuda"))
    k, v = cache.layer(5)
    order = torch.randperm(need, generator=generator) + 1
    tables = torch.zeros(batch, TABLE_WIDTH, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens.tolist()):
        blocks = -(-n // BS)
        tables[i, :blocks] = order[used : used + blocks]
        used += blocks
    query = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    return query, k, v, tables.cuda(), lens.to(torch.int32).cuda()


def sweep(
    batch: int,
    generator: torch.Generator,
    fine: bool,
    kv_dtype: torch.dtype,
    default_only: bool,
    register_caps: list[int],
) -> None:
    query, k, v, tables, lens = case(batch, generator, kv_dtype)
    nbytes = int(lens.sum()) * HKV * D * 2 * k.element_size()  # K and V
    want = reference.paged_decode_attention(query, k, v, tables, lens, 0.088).float()
    got = dec.paged_decode_attention(query, k, v, tables, lens, 0.088).float()
    err = float((got - want).abs().max())

    def run(**kw: int | bool | None) -> float:
        def fn() -> torch.Tensor:
            return dec.paged_decode_attention(query, k, v, tables, lens, 0.088, **kw)

        # replayed from a CUDA graph, as in the engine: a Python launch takes longer than the
        # kernel at small batches, so timing plain launches measures the host
        return float(triton.testing.do_bench_cudagraph(fn, rep=20))

    default_ms = run()
    as_bytes = ""
    if kv_dtype != torch.bfloat16:  # the FP8 cache read as bytes instead of int32 words
        ms = run(fp8_words=False)
        as_bytes = f"; read as bytes {ms * 1e3:.1f} us = {nbytes / ms / 1e9:.2f} TB/s"
    results = []
    auto = dec.choose_num_splits(batch, HKV, TABLE_WIDTH * BS, dec._num_sms(0))
    splits = sorted({1, 2, 4, 8, 16, 32, 64, auto} if batch < 32 else {1, 2, 3, 4, 6, 8, 16, auto})
    tiles, stage_counts, top = (
        ((32, 64, 128, 256), (1, 2, 3, 4), 12) if fine else ((16, 32, 64), (1, 2, 3), 5)
    )
    if fine:
        splits = sorted({max(1, auto // 2), auto, auto + 1, auto * 2, 1})
    if default_only:
        splits = []
    for n, bn, warps, stages in itertools.product(splits, tiles, (2, 4, 8), stage_counts):
        try:
            ms = run(num_splits=n, block_n=bn, num_warps=warps, num_stages=stages)
        except Exception as err:  # out of shared memory and the like
            print(f"  skip splits={n} block_n={bn} warps={warps} stages={stages}: {err!r}"[:150])
            continue
        results.append((ms, n, bn, warps, stages))
    results.sort()
    print(
        f"batch {batch}, {kv_dtype} cache: context {int(lens.sum())} tokens, "
        f"{nbytes / 1e6:.1f} MB; default (splits {auto}) {default_ms * 1e3:.1f} us = "
        f"{nbytes / default_ms / 1e9:.2f} TB/s, largest error against float32 {err:.2e}" + as_bytes
    )
    for ms, n, bn, warps, stages in results[:top]:
        print(
            f"  {ms * 1e3:7.1f} us = {nbytes / ms / 1e9:.2f} TB/s  splits={n} block_n={bn} "
            f"warps={warps} stages={stages}"
        )
    for cap in register_caps:  # the default launch, its registers capped (kernel_sass.py)
        capped = dec.paged_decode_attention(query, k, v, tables, lens, 0.088, max_registers=cap)
        cap_err = float((capped.float() - want).abs().max())
        ms = run(max_registers=cap)
        print(
            f"  {ms * 1e3:7.1f} us = {nbytes / ms / 1e9:.2f} TB/s  default, at most {cap} "
            f"registers (default alternating: {run() * 1e3:.1f} us), error {cap_err:.2e}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--fine", action="store_true", help="more tiles, stages, top 12")
    parser.add_argument("--default-only", action="store_true", help="no sweep, the default only")
    parser.add_argument(
        "--max-registers",
        type=int,
        nargs="*",
        default=[],
        help="also time the default launch with these caps on registers per thread",
    )
    parser.add_argument(
        "--kv-dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn", "float8_e5m2")
    )
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    name = torch.cuda.get_device_name()
    print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}")
    for batch in args.batches:
        kv_dtype = getattr(torch, args.kv_dtype)
        sweep(batch, generator, args.fine, kv_dtype, args.default_only, args.max_registers)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
