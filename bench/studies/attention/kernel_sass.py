"""Decode attention compiled for Hopper without a GPU: registers, shared memory, programs per SM
and the main loop's instructions, from the SASS the launch would run.

    .venv/bin/python -P bench/studies/attention/kernel_sass.py \\
        | tee bench/studies/attention/kernel_sass.txt

Triton compiles `_decode_kernel` for sm_90 with the specialization a real launch gets (Llama-3-8B
on the engine's layout: 32 query and 8 KV heads of 128 values, 16-token blocks; every pointer
and every integer argument divisible by 16 marked so) for each configuration, then its own
nvdisasm and cuobjdump read the cubin. The loop is the span of the one backward branch; its
instructions are per warp and per tile. `--triton DIR` puts another Triton first on the path,
e.g. the lent GPU's version, installed here with
`.venv/bin/uv pip install --target /tmp/t36 triton==3.6.0`.

What it cannot say: how long anything takes. The issue estimate is the loop's instructions at one
per cycle per scheduler over the 256-sequence batch at the H200's 1.98 GHz, a floor that
ignores every stall; times come from decode_attention_sweep.py on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from types import ModuleType

NUM_SMS, SCHEDULERS, CLOCK_HZ = 132, 4, 1.98e9  # H200
REGS_PER_SM, SMEM_PER_SM, SMEM_PER_BLOCK_RESERVED, MAX_WARPS = 65536, 233472, 1024, 64
HQ, HKV, D, BS = 32, 8, 128, 16
BATCH, MEAN_CONTEXT = 256, 576  # 512-640 tokens, as decode_attention_sweep.py draws them
# the engine's launches at 256 sequences (FP8 and bf16 caches) and at 32 (FP8), and caps
DEFAULT_CONFIGS = ("fp8:64:4:2", "fp8:64:4:2:96", "fp8:64:4:2:80", "fp8:128:8:2", "bf16:64:4:3",
                   "bf16:64:4:3:96")  # fmt: skip


@dataclass(frozen=True)
class Config:
    kv: str  # "fp8" (read as int32 words) or "bf16"
    block_n: int
    warps: int
    stages: int
    max_registers: int | None = None

    @classmethod
    def parse(cls, text: str) -> Config:
        """KV:BLOCK_N:WARPS:STAGES[:MAXNREG], e.g. fp8:64:4:2 or fp8:64:4:2:96."""
        kv, *nums = text.split(":")
        if kv not in ("fp8", "bf16") or len(nums) not in (3, 4):
            raise argparse.ArgumentTypeError(f"not KV:BLOCK_N:WARPS:STAGES[:MAXNREG]: {text}")
        values = [int(n) for n in nums]
        return cls(kv, *values[:3], values[3] if len(values) == 4 else None)


def compile_kernel(triton: ModuleType, dec: ModuleType, cfg: Config) -> tuple[bytes, int]:
    """The cubin of `_decode_kernel` for `cfg` on sm_90, and its shared memory in bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = dec._decode_kernel
    fp8 = cfg.kv == "fp8"
    unit = 4 if fp8 else 1  # an FP8 cache's strides count int32 words
    kv_ptr = "*fp8e4nv" if fp8 else "*bf16"
    pointers = {
        "query": "*bf16", "k_cache": kv_ptr, "v_cache": kv_ptr, "block_tables": "*i32",
        "seq_lens": "*i32", "out": "*bf16", "part_ml": "*fp32", "part_acc": "*fp32",
    }  # fmt: skip
    block_stride, token_stride, head_stride = BS * HKV * D // unit, HKV * D // unit, D // unit
    ints = {
        "stride_qs": HQ * D, "stride_qh": D, "stride_os": HQ * D, "stride_oh": D,
        "stride_kb": block_stride, "stride_ks": token_stride, "stride_kh": head_stride,
        "stride_vb": block_stride, "stride_vs": token_stride, "stride_vh": head_stride,
        "block_size": BS, "group": HQ // HKV, "head_dim": D, "num_heads": HQ,
    }  # fmt: skip
    constants = {
        "G_PAD": 16, "D_PAD": D, "BLOCK_N": cfg.block_n, "DIRECT": True, "IEEE": False,
        "KV_FP8": fp8, "KV_WORDS": fp8, "PDL": True,
    }  # fmt: skip
    not_specialized = {fn.arg_names[a] if isinstance(a, int) else a for a in fn.do_not_specialize}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name not in not_specialized and ints.get(name, 1) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()},
        attrs=attrs,
    )
    options: dict[str, int] = {"num_warps": cfg.warps, "num_stages": cfg.stages}
    if cfg.max_registers is not None:
        options["maxnreg"] = cfg.max_registers
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return kernel.asm["cubin"], int(kernel.metadata.shared)


def nvidia_tool(triton: ModuleType, name: str, *args: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return subprocess.run([tool, *args], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> list[str]:
    """The opcodes of the body of the longest loop (from a label to a branch back to it)."""
    labels: dict[str, int] = {}
    ops: list[str] = []
    loops: list[tuple[int, int]] = []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        ins = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if not ins:
            continue
        text = re.sub(r"^@!?U?P\w+\s+", "", ins.group(1))  # the predicate, if any
        target = re.search(r"(\.L_x_\d+)", text)
        if text.startswith("BRA") and target and target.group(1) in labels:  # backward
            loops.append((labels[target.group(1)], len(ops)))
        ops.append(text.split()[0])
    if not loops:
        return []
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return ops[start : end + 1]


def programs_per_sm(registers: int, smem: int, warps: int) -> tuple[int, int]:
    """Resident programs per SM allowed by registers (allocated per warp in units of 256) and by
    shared memory (plus the 1 KiB the driver reserves per block)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = min(REGS_PER_SM // per_warp, MAX_WARPS) // warps
    by_smem = SMEM_PER_SM // (smem + SMEM_PER_BLOCK_RESERVED)
    return by_regs, by_smem


def report(triton: ModuleType, dec: ModuleType, cfg: Config) -> None:
    cubin, smem = compile_kernel(triton, dec, cfg)
    path = f"/tmp/kvrail-kernel-sass-{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(cubin)
    try:
        usage = nvidia_tool(triton, "cuobjdump", "-res-usage", path)
        sass = nvidia_tool(triton, "nvdisasm", "-c", path)
    finally:
        os.remove(path)
    registers = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))  # type: ignore[union-attr]
    by_regs, by_smem = programs_per_sm(registers, smem, cfg.warps)
    body = main_loop(sass)
    counts = collections.Counter(op.split(".")[0] for op in body)
    moves = sum(1 for op in body if op.startswith(("MOV", "IMAD.MOV")))
    tiles = -(-MEAN_CONTEXT // cfg.block_n)
    issue_s = BATCH * HKV * tiles * len(body) * cfg.warps / (NUM_SMS * SCHEDULERS * CLOCK_HZ)
    cap = "" if cfg.max_registers is None else f", cap {cfg.max_registers}"
    print(
        f"{cfg.kv} cache, {cfg.block_n}-token tiles, {cfg.warps} warps, {cfg.stages} stages{cap}: "
        f"{registers} registers, {stack} B stack, {smem / 1024:.1f} KiB shared; programs per SM "
        f"{min(by_regs, by_smem)} (registers allow {by_regs}, shared memory {by_smem})"
    )
    print(
        f"  loop: {len(body)} instructions a warp a tile, {moves} of them moves; issue floor at "
        f"{BATCH} sequences {issue_s * 1e6:.0f} us"
    )
    print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(16)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--triton", help="a folder holding another Triton, put first on the path")
    parser.add_argument(
        "--configs",
        nargs="+",
        type=Config.parse,
        default=[Config.parse(c) for c in DEFAULT_CONFIGS],
        help="KV:BLOCK_N:WARPS:STAGES[:MAXNREG] (default: the engine's at 256 and 32 "
        "sequences, and register caps)",
    )
    args = parser.parse_args()
    if args.triton:
        sys.path.insert(0, args.triton)
    import triton

    from kvrail.kernels import decode_attention as dec

    print(f"# triton {triton.__version__} ({os.path.dirname(triton.__file__)}), sm_90, no GPU")
    for cfg in args.configs:
        report(triton, dec, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
