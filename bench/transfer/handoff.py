"""KV handoff between two processes: bandwidth and latency per transport, size and layout.

    .venv/bin/python -P bench/transfer/handoff.py --device cpu            # here
    python3 -P bench/transfer/handoff.py --device cuda --out $OUT/x.json  # on the lent H200

Each mode runs in a fresh writer/reader process pair (UCX reads its environment at start):
NIXL with UCX's default transport selection, NIXL with UCX restricted to the CUDA IPC transports
(GPU only), NIXL with UCX restricted to shared memory (CPU only), and kvrail's same-node CUDA
IPC path (GPU only; NIXL carries only the notification).
The baseline, measured in the same run, is a same-process copy of the same bytes on the same
device (`torch` copy_). Every mode's last write is checked byte for byte by checksum.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

MODES: dict[str, dict[str, Any]] = {
    "nixl-ucx-default": {"env": {}, "prefer_ipc": False, "devices": ("cpu", "cuda")},
    "nixl-ucx-sm": {
        "env": {"UCX_TLS": "sm,tcp,self"},
        "prefer_ipc": False,
        "devices": ("cpu",),
    },
    "nixl-ucx-cuda-tls": {
        "env": {"UCX_TLS": "cuda_ipc,cuda_copy,sm,self", "UCX_RNDV_THRESH": "0"},
        "prefer_ipc": False,
        "devices": ("cuda",),
    },
    "kvrail-cuda-ipc": {"env": {}, "prefer_ipc": True, "devices": ("cuda",)},
}


def _region(device: str, num_blocks: int, block_bytes: int, fill: str) -> Any:
    import torch

    from kvrail.worker.transfer.connector import BlockRegion

    shape = (num_blocks, block_bytes // 2)
    if fill == "random":
        t = torch.randn(shape, dtype=torch.bfloat16, device=device)
    else:
        t = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    return BlockRegion(t, num_blocks)


def _reader(conn: Connection, env: dict[str, str], args: dict[str, Any]) -> None:
    os.environ.update(env)
    from kvrail.worker.transfer.envelope import block_checksums
    from kvrail.worker.transfer.nixl import NixlConnector
    from kvrail.worker.transfer.testing import recv

    region = _region(args["device"], args["num_blocks"], args["block_bytes"], "zeros")
    nixl = NixlConnector("reader-1", region, prefer_ipc=args["prefer_ipc"])
    conn.send(nixl.metadata())
    nixl.add_peer(recv(conn))  # type: ignore[arg-type]
    received = 0
    while not conn.poll(0.0005):
        received += len(nixl.notifications())
    block_ids = recv(conn)
    received += len(nixl.notifications())
    conn.send((received, block_checksums(region, block_ids)))  # type: ignore[arg-type]
    recv(conn)
    nixl.close()


def _run_mode(name: str, mode: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Writer side in this (spawned) process, reader in another."""
    import random

    import torch

    from kvrail.worker.transfer.envelope import block_checksums
    from kvrail.worker.transfer.nixl import NixlConnector
    from kvrail.worker.transfer.testing import recv

    block_bytes = args.block_kib * 1024
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mib.split(",")]
    num_blocks = max(1, max(sizes) // block_bytes)
    cfg = {"device": args.device, "num_blocks": num_blocks, "block_bytes": block_bytes,
           "prefer_ipc": mode["prefer_ipc"]}  # fmt: skip
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    reader = ctx.Process(target=_reader, args=(child, mode["env"], cfg), daemon=True)
    reader.start()
    region = _region(args.device, num_blocks, block_bytes, "random")
    nixl = NixlConnector("writer-1", region, prefer_ipc=mode["prefer_ipc"])
    peer = nixl.add_peer(recv(parent))  # type: ignore[arg-type]
    parent.send(nixl.metadata())
    transport = nixl.transport_to(peer)
    rows = []
    rng = random.Random(0)
    try:
        for size in sizes:
            n = max(1, size // block_bytes)
            for layout in args.layouts.split(","):
                src = list(range(n))
                dst = list(range(n)) if layout == "contiguous" else rng.sample(range(num_blocks), n)
                times = []
                for i in range(args.warmup + args.iters):
                    stats = nixl.write(peer, src, dst, b"x", time.monotonic() + 120)
                    if i >= args.warmup:
                        times.append(stats.seconds)
                med = statistics.median(times)
                nbytes = n * block_bytes
                rows.append({"mode": name, "transport": transport, "layout": layout,
                             "bytes": nbytes, "blocks": n, "median_s": med,
                             "min_s": min(times), "gb_per_s": nbytes / med / 1e9})  # fmt: skip
                mib, gbs = nbytes / 2**20, nbytes / med / 1e9
                print(f"  {name:<18} {layout:<10} {mib:>8.1f} MiB {med * 1e3:>9.3f} ms "
                      f"{gbs:>9.1f} GB/s", flush=True)  # fmt: skip
        parent.send(dst)
        received, landed = recv(parent)  # type: ignore[misc]
        expected = block_checksums(region, src)
        ok = landed == expected
        for row in rows:
            row["verified"] = ok
        print(f"  {name}: last write verified={ok} notifications={received}", flush=True)
        parent.send("bye")
    finally:
        reader.join(timeout=30)
        if reader.is_alive():
            reader.kill()
        nixl.close()
    del torch
    return rows


def _mode_entry(conn: Connection, name: str, args: argparse.Namespace) -> None:
    mode = MODES[name]
    os.environ.update(mode["env"])
    try:
        conn.send(("ok", _run_mode(name, mode, args)))
    except Exception as err:
        conn.send(("error", f"{type(err).__name__}: {err}"))


def _baseline(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    rows = []
    for s in args.sizes_mib.split(","):
        size = int(float(s) * (1 << 20))
        a = torch.randn(size // 2, dtype=torch.bfloat16, device=args.device)
        b = torch.empty_like(a)
        times = []
        for i in range(args.warmup + args.iters):
            if args.device == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                b.copy_(a)
                end.record()
                end.synchronize()
                t = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                b.copy_(a)
                t = time.perf_counter() - t0
            if i >= args.warmup:
                times.append(t)
        med = statistics.median(times)
        rows.append({"mode": "same-process-copy", "bytes": size, "median_s": med,
                     "gb_per_s": size / med / 1e9})  # fmt: skip
        print(f"  {'same-process copy':<29} {size / 2**20:>8.1f} MiB {med * 1e3:>9.3f} ms "
              f"{size / med / 1e9:>9.1f} GB/s", flush=True)  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--sizes-mib", default="1,16,256,1024")
    p.add_argument("--layouts", default="contiguous,scattered")
    p.add_argument("--block-kib", type=int, default=2048, help="bytes per KV block (all layers)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "host": platform.node(), "cpus": os.cpu_count(), "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "block_kib": args.block_kib, "iters": args.iters}  # fmt: skip
    print(json.dumps(info), flush=True)
    results: dict[str, Any] = {"info": info, "baseline": _baseline(args), "modes": [], "errors": {}}
    ctx = mp.get_context("spawn")
    for name in args.modes.split(","):
        if args.device not in MODES[name]["devices"]:
            continue
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_mode_entry, args=(child, name, args))
        proc.start()
        if parent.poll(540):
            status, payload = parent.recv()
        else:
            status, payload = "error", "timed out"
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        if status == "ok":
            results["modes"].extend(payload)
        else:
            results["errors"][name] = payload
            print(f"  {name}: FAILED {payload}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
