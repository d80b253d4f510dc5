"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

On Hopper and later GPUs a kernel launched with PDL may be scheduled while the kernel before it
on the stream is still running. Each of these kernels starts with `gdc_wait` (wait until the
previous kernel has finished and its writes are visible) before it loads or stores anything, so
every result is the one an ordinary launch gives; it calls `gdc_launch_dependents` (let the next
kernel be scheduled) at its start when it is short (norms, rotary, SiLU) and after its main loop
when it is long (the skinny GEMM, decode attention). What PDL removes is the idle time between
kernels: the launch latency and the previous kernel's last, partly empty wave. A decode step of
a Llama-8B runs about 350 kernels, so those gaps add up. Letting the next kernel in at the start
of a GEMM, or prefetching part of the GEMM's weight into L2 before its wait, made a 32-layer
chain slower (bench/studies/gemm/pdl_chain.txt), so neither is done.

Only kernels of ours take part: cuBLAS and torch kernels launch as usual, so the projections of
decode batches run on the skinny GEMM (`kvrail.kernels.dispatch.linear`) when PDL is on.

`pdl(device)` is true for CUDA devices of compute capability 9.0 or later unless the environment
sets `KVRAIL_PDL=0` (the benchmarks' A/B switch, and a way out should a driver misbehave). It is
read at each launch, so CUDA graphs keep what was set when they were captured.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "KVRAIL_PDL"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor


def pdl(device: torch.device) -> bool:
    """Launch this device's decode kernels with programmatic dependent launch?"""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0":
        return False
    return _capability(device.index or 0) >= (9, 0)
