"""CUDA IPC: map a peer process's KV region on the same node and copy blocks device to device.

On one node this is the fastest path between two processes (2.07 TB/s measured for 1 GiB on the
lent H200, where NIXL's default UCX selection moved 0.46 GB/s). The exporter publishes a
fixed-layout description (never a pickle: it travels through etcd):

    64-byte cudaIpcMemHandle | u64 offset into the allocation | u64 nbytes | u32 device | u32 pid

and the importer maps the allocation once and views the region as a uint8 tensor.
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Any

import torch

from kvrail.errors import TransferError

_LAYOUT = struct.Struct("<64sQQII")
HANDLE_BYTES = _LAYOUT.size


def _cuda() -> tuple[Any, Any]:
    try:
        from cuda.bindings import driver, runtime
    except ImportError as err:
        raise TransferError("CUDA IPC needs the cuda-bindings package") from err
    return driver, runtime


def _check(result: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    err, *rest = result
    if int(err) != 0:
        raise TransferError(f"{what} failed with CUDA error {int(err)}")
    return tuple(rest)


def export_region(tensor: torch.Tensor) -> bytes:
    """The IPC description of a contiguous CUDA tensor's memory."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise TransferError("only a contiguous CUDA tensor can be exported over CUDA IPC")
    driver, runtime = _cuda()
    ptr = tensor.data_ptr()
    with torch.cuda.device(tensor.device):
        # The driver API needs the device's context current on this thread, and a worker builds
        # its engine (and so the context) on another one: cudaFree(0) binds it here first.
        _check(runtime.cudaFree(0), "cudaFree")
        base, _ = _check(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        (handle,) = _check(runtime.cudaIpcGetMemHandle(int(base)), "cudaIpcGetMemHandle")
    raw = ctypes.string_at(handle.getPtr(), 64)
    nbytes = tensor.numel() * tensor.element_size()
    return _LAYOUT.pack(raw, ptr - int(base), nbytes, tensor.device.index or 0, os.getpid())


class _CudaArray:
    """Just enough of `__cuda_array_interface__` for torch.as_tensor to wrap a raw pointer."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
        }  # fmt: skip


class ImportedRegion:
    """A peer's region mapped into this process; `close()` unmaps it."""

    def __init__(self, description: bytes, device: torch.device) -> None:
        if len(description) != HANDLE_BYTES:
            raise TransferError("CUDA IPC description has the wrong size")
        raw, offset, nbytes, _peer_device, self.peer_pid = _LAYOUT.unpack(description)
        if self.peer_pid == os.getpid():
            raise TransferError("a process cannot open its own CUDA IPC handle")
        _, runtime = _cuda()
        self._runtime = runtime
        handle = runtime.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), raw, 64)
        with torch.cuda.device(device):
            (base,) = _check(
                runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess),
                "cudaIpcOpenMemHandle",
            )
            self._base = int(base)
            self.tensor = torch.as_tensor(_CudaArray(self._base + offset, nbytes), device=device)

    def close(self) -> None:
        if self._base:
            torch.cuda.synchronize()
            _check(self._runtime.cudaIpcCloseMemHandle(self._base), "cudaIpcCloseMemHandle")
            self._base = 0
