"""Where one CUDA IPC handoff's wall time goes, on the GPU: `handoff.py`'s `kvrail-cuda-ipc`
mode (writer here, reader in another process) with the writer's `_write_ipc` and its copy
(`GraphedBlockCopy.copy`: ids staged, the graph replayed) timed from the outside: host time
before the copy (runs counted), the copy call itself, the GPU time from just before it to the
kernel's end (CUDA events on the connector's stream), and the host time after it (waiting for
the stream, the notification).

    python3 -P bench/studies/handoff/ipc_split.py  # an 8k prompt's KV, FP8 (512 x 1 MiB) and bf16

Results: bench/transfer/handoff-ab-2026-12-05/ipc_split.txt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "transfer"))  # handoff


def main() -> int:
    import handoff

    from kvrail.worker.transfer import ipc_copy, kv_connector

    rows: list[tuple[float, ...]] = []
    last: dict[str, Any] = {}
    copy, write_ipc = ipc_copy.GraphedBlockCopy.copy, kv_connector.KvConnector._write_ipc

    def timed_copy(self: Any, *args: Any) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        last["before"] = time.perf_counter()
        start.record(self._stream)
        copy(self, *args)
        end.record(self._stream)
        last["after"], last["events"] = time.perf_counter(), (start, end)

    def timed_write(self: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = write_ipc(self, *args)
        t1 = time.perf_counter()
        start, end = last["events"]
        rows.append((
            last["before"] - t0, last["after"] - last["before"], start.elapsed_time(end) / 1e3,
            t1 - last["after"], t1 - t0,
        ))  # fmt: skip
        return out

    ipc_copy.GraphedBlockCopy.copy = timed_copy  # type: ignore[method-assign]
    kv_connector.KvConnector._write_ipc = timed_write  # type: ignore[method-assign]
    names = ("before the copy", "copy call", "GPU (events)", "after the call", "total")
    for mib, kib in ((512, 1024), (1024, 2048)):
        rows.clear()
        args = argparse.Namespace(
            device="cuda", sizes_mib=str(mib), layouts="scattered", block_kib=kib, iters=20,
            warmup=2, reader_gpu=None, out=None,
        )  # fmt: skip
        handoff._run_mode("kvrail-cuda-ipc", handoff.MODES["kvrail-cuda-ipc"], args)
        columns = list(zip(*rows[2:], strict=True))
        medians = ", ".join(
            f"{n} {statistics.median(c) * 1e6:.0f}" for n, c in zip(names, columns, strict=True)
        )
        print(f"{mib} MiB in {kib} KiB blocks, median us: {medians}")
        print("   totals:", [round(t * 1e6) for t in columns[-1]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
