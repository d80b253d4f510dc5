"""CUDA IPC export: a region allocated on one thread is exported from another.

A worker builds its engine (and so its CUDA context) on a thread of its own, then exports the KV
region from the event loop's thread, where no context was current: `cuMemGetAddressRange` then
failed with CUDA error 201 (invalid context) and no worker could start on a GPU. Exporting must
bind the device's context first. The handle is then opened by a second process, which sees the
bytes written here.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from kvrail.worker.transfer.cuda_ipc import HANDLE_BYTES, export_region

_PEER = """
import sys, torch
from kvrail.worker.transfer.cuda_ipc import ImportedRegion
region = ImportedRegion(bytes.fromhex(sys.argv[1]), torch.device("cuda", 0))
print(region.tensor[:4].cpu().tolist())
region.close()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_region_built_on_one_thread_is_exported_from_another_and_read_by_a_peer() -> None:
    made: list[torch.Tensor] = []
    builder = threading.Thread(
        target=lambda: made.append(torch.arange(4096, dtype=torch.uint8, device="cuda"))
    )
    builder.start()
    builder.join()
    exported: list[bytes] = []
    exporter = threading.Thread(target=lambda: exported.append(export_region(made[0])))
    exporter.start()
    exporter.join()
    assert len(exported) == 1 and len(exported[0]) == HANDLE_BYTES
    torch.cuda.synchronize()
    peer = subprocess.run(
        [sys.executable, "-P", "-c", _PEER, exported[0].hex()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert peer.returncode == 0, peer.stderr
    assert peer.stdout.strip() == "[0, 1, 2, 3]"
