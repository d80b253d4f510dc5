"""Test helper: the Triton kernel modules, interpreted on CPU when there is no CUDA.

Triton picks its interpreter when a kernel is defined (TRITON_INTERPRET), so `load_kernels` sets
the variable and reloads kernel modules that were defined compiled. Its own library (`tl.sum`,
`tl.max`...) is defined when triton is first imported, and cannot be reloaded: without CUDA the
variable must be set before that (the test suite's conftest does), and `load_kernels` refuses a
process where it was not. Never used in production code.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

KERNEL_MODULES = (
    "kv_write",
    "race",
    "token_bitmask",
    "paged_kv",
    "prefix_attention",
    "decode_attention",
    "prefill_attention",
    "block_copy",
    "rms_norm",
    "silu_and_mul",
    "rotary_kv",
    "skinny_gemm",
    "argmax",
    "fp8_gemm",
)


def load_kernels() -> dict[str, ModuleType]:
    """{name: module} for every kernel module; interpreted (CPU-capable) when CUDA is absent."""
    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"
        _check_library_interpreted()
    modules = {}
    for name in KERNEL_MODULES:
        full = f"kvrail.kernels.{name}"
        module = sys.modules.get(full)
        if module is None:
            module = importlib.import_module(full)
        elif not has_cuda and not _is_interpreted(module):
            module = importlib.reload(module)
        modules[name] = module
    return modules


def _check_library_interpreted() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.sum, InterpretedFunction):
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its library is compiled "
            "and cannot run interpreted: set TRITON_INTERPRET=1 before anything imports triton"
        )


def _is_interpreted(module: ModuleType) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return any(isinstance(v, InterpretedFunction) for v in vars(module).values())
