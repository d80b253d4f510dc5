"""KV handoff between two processes: bandwidth and latency per transport, size and layout.

    .venv/bin/python -P bench/transfer/handoff.py --device cpu            # here
    python3 -P bench/transfer/handoff.py --device cuda --out $OUT/x.json  # on the lent H200
    python3 -P bench/transfer/handoff.py --device cuda --reader-gpu 1 --out $OUT/x.json  # 2 GPUs

Each mode runs in a fresh writer/reader process pair (UCX reads its environment at start):
NIXL with UCX's default transport selection, NIXL with UCX restricted to the CUDA IPC transports
(GPU only), NIXL with UCX restricted to shared memory (CPU only), and kvrail's same-node CUDA
IPC path (GPU only; NIXL carries only the notification).
The baseline, measured in the same run, is a same-process copy of the same bytes on the same
device (`torch` copy_). Every mode's last write is checked byte for byte by checksum.

`--reader-gpu N` puts the reader on cuda:N (the writer stays on cuda:0; both processes see every
GPU, as CUDA IPC between GPUs needs). It adds a baseline of a same-process copy from cuda:0 to
cuda:N, and the mode `cuda-ipc-peer`: the reader's region mapped over CUDA IPC on the reader's
own device (where the memory lives) and written with `torch` copy_ across devices, one copy per
contiguous run, with NIXL carrying only the notification. `kvrail-cuda-ipc` maps it on the
writer's device, as the worker does; its rows record where the mapping landed.
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
    "cuda-ipc-peer": {"env": {}, "prefer_ipc": False, "devices": ("cuda",), "peer_map": True},
}


def _region(device: str, num_blocks: int, block_bytes: int, fill: str) -> Any:
    import torch

    from kvrail.worker.kv_cache import KVCache

    shape = (num_blocks, block_bytes // 2)
    if fill == "random":
        t = torch.randn(shape, dtype=torch.bfloat16, device=device)
    else:
        t = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    return KVCache(t, num_blocks)


def _reader(conn: Connection, env: dict[str, str], args: dict[str, Any]) -> None:
    os.environ.update(env)
    import torch

    from kvrail.worker.transfer.cuda_ipc import export_region
    from kvrail.worker.transfer.envelope import block_checksums
    from kvrail.worker.transfer.kv_connector import KvConnector
    from kvrail.worker.transfer.testing import recv

    if args["device"].startswith("cuda:"):
        torch.cuda.set_device(torch.device(args["device"]))
    region = _region(args["device"], args["num_blocks"], args["block_bytes"], "zeros")
    nixl = KvConnector("reader-1", region, prefer_ipc=args["prefer_ipc"])
    conn.send(nixl.metadata())
    if args["peer_map"]:
        conn.send(export_region(region.tensor))
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
    from kvrail.worker.transfer.kv_connector import KvConnector
    from kvrail.worker.transfer.testing import recv

    block_bytes = args.block_kib * 1024
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mib.split(",")]
    num_blocks = max(1, max(sizes) // block_bytes)
    writer_device, reader_device = _devices(args)
    peer_map = bool(mode.get("peer_map"))
    cfg = {"device": reader_device, "num_blocks": num_blocks, "block_bytes": block_bytes,
           "prefer_ipc": mode["prefer_ipc"], "peer_map": peer_map}  # fmt: skip
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    reader = ctx.Process(target=_reader, args=(child, mode["env"], cfg), daemon=True)
    reader.start()
    region = _region(writer_device, num_blocks, block_bytes, "random")
    nixl = KvConnector("writer-1", region, prefer_ipc=mode["prefer_ipc"])
    peer = nixl.add_peer(recv(parent))  # type: ignore[arg-type]
    mapped = None
    if peer_map:
        from kvrail.worker.transfer.cuda_ipc import ImportedRegion

        mapped = ImportedRegion(recv(parent), torch.device(reader_device))  # type: ignore[arg-type]
    parent.send(nixl.metadata())
    transport = "cuda-ipc-peer" if peer_map else nixl.transport_to(peer)
    where = _ipc_placement(nixl, peer)
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
                    if mapped is None:
                        seconds = nixl.write(peer, src, dst, b"x", time.monotonic() + 120).seconds
                    else:
                        seconds = _write_peer(nixl, peer, region, mapped.tensor, src, dst)
                    if i >= args.warmup:
                        times.append(seconds)
                med = statistics.median(times)
                nbytes = n * block_bytes
                rows.append({"mode": name, "transport": transport, "layout": layout,
                             "bytes": nbytes, "blocks": n, "median_s": med,
                             "min_s": min(times), "gb_per_s": nbytes / med / 1e9,
                             "writer_device": writer_device, "reader_device": reader_device,
                             **where})  # fmt: skip
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
        if mapped is not None:
            with torch.cuda.device(mapped.tensor.device):
                mapped.close()
        nixl.close()
    return rows


def _devices(args: argparse.Namespace) -> tuple[str, str]:
    """(writer's, reader's) torch device."""
    if args.reader_gpu is None:
        return args.device, args.device
    return "cuda:0", f"cuda:{args.reader_gpu}"


def _ipc_placement(nixl: Any, peer: str) -> dict[str, Any]:
    """Where kvrail's CUDA IPC mapping of the peer's region landed in this process: the torch
    device of the tensor, and its address minus the mapped allocation's base (a small offset when
    the tensor is the mapping itself; anything else means torch copied the bytes elsewhere, and
    writes would miss the peer). Reads KvConnector internals: this is a diagnostic."""
    remote = nixl._peers[peer]
    if remote.ipc is None:
        return {}
    ipc = remote.ipc
    return {"ipc_tensor_device": str(ipc.tensor.device),
            "ipc_offset_from_mapping": ipc.tensor.data_ptr() - ipc._base}  # fmt: skip


def _write_peer(nixl: Any, peer: str, region: Any, dst_tensor: Any, src: list[int],
                dst: list[int]) -> float:  # fmt: skip
    """One handoff into a region mapped on the reader's device: a cross-device copy per
    contiguous run, both devices synchronized, then NIXL's notification (as kvrail's path)."""
    import torch

    from kvrail.worker.transfer.blocks import coalesce

    size = region.block_bytes
    flat = region.tensor.view(-1).view(torch.uint8)
    started = time.perf_counter()
    for s, d, n in coalesce(src, dst):
        dst_tensor[d * size : (d + n) * size].copy_(flat[s * size : (s + n) * size])
    torch.cuda.synchronize(region.tensor.device)
    torch.cuda.synchronize(dst_tensor.device)
    nixl._agent.send_notif(peer, b"x")
    return time.perf_counter() - started


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
        if args.reader_gpu is not None:
            rows.append(_peer_copy(args, a, size))
    return rows


def _peer_copy(args: argparse.Namespace, a: Any, size: int) -> dict[str, Any]:
    """The same bytes copied in one process from cuda:0 to the reader's GPU (wall clock, both
    devices synchronized, as the handoff modes are timed)."""
    import torch

    b = torch.empty_like(a, device=f"cuda:{args.reader_gpu}")
    times = []
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(a.device)
        torch.cuda.synchronize(b.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(f"  {'peer copy cuda:0 -> ' + str(b.device):<29} {size / 2**20:>8.1f} MiB "
          f"{med * 1e3:>9.3f} ms {size / med / 1e9:>9.1f} GB/s", flush=True)  # fmt: skip
    return {"mode": "same-process-peer-copy", "bytes": size, "median_s": med,
            "gb_per_s": size / med / 1e9, "src": str(a.device), "dst": str(b.device)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--sizes-mib", default="1,16,256,1024")
    p.add_argument("--layouts", default="contiguous,scattered")
    p.add_argument("--block-kib", type=int, default=2048, help="bytes per KV block (all layers)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--reader-gpu", type=int, help="the reader on this cuda index (writer: 0)")
    p.add_argument("--out", help="write the results as JSON here (rewritten after each mode)")
    args = p.parse_args()
    import torch

    if args.reader_gpu is not None and args.device != "cuda":
        p.error("--reader-gpu needs --device cuda")
    if args.reader_gpu is not None and not 0 < args.reader_gpu < torch.cuda.device_count():
        p.error(f"--reader-gpu {args.reader_gpu}: this machine has "
                f"{torch.cuda.device_count()} visible GPUs")  # fmt: skip
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "host": platform.node(), "cpus": os.cpu_count(), "device": args.device,
            "gpu": gpus[0] if args.device == "cuda" else None,
            "block_kib": args.block_kib, "iters": args.iters, "warmup": args.warmup,
            "command": " ".join(sys.argv)}  # fmt: skip
    if args.reader_gpu is not None:
        info.update(gpus=gpus, writer_gpu=0, reader_gpu=args.reader_gpu,
                    peer_access=torch.cuda.can_device_access_peer(0, args.reader_gpu))  # fmt: skip
    print(json.dumps(info), flush=True)
    results: dict[str, Any] = {"info": info, "baseline": _baseline(args), "modes": [], "errors": {}}
    _save(args.out, results)
    ctx = mp.get_context("spawn")
    for name in args.modes.split(","):
        if args.device not in MODES[name]["devices"]:
            continue
        if MODES[name].get("peer_map") and args.reader_gpu is None:
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
        _save(args.out, results)
    return 0


def _save(path: str | None, results: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
