"""Host-to-device copy bandwidth: what a host KV tier's loads can reach at best on this machine.

    python3 -P bench/serving/h2d_probe.py --gib 4 --out $OUT/h2d.json      # on the lent GPU

Copies `--gib` GiB from pinned host memory to the GPU (`copy_`, non-blocking, timed with CUDA
events) as one tensor and in blocks of each `--block-mib` size (a KV block of Llama-3-8B bf16 is
2 MiB over its 32 layers, 64 KiB per layer's K or V: the sizes a tier's load copies), `--repeats`
times each, and the reverse direction (device to pinned host: the tier's write-behind) for the
whole tensor. Prints one JSON line per measurement (GB/s = 1e9 bytes/s, the best and the median
of the repeats) and writes them all to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def timed_gbps(copy: Any, nbytes: int, repeats: int) -> dict[str, float]:
    import torch

    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        end.synchronize()
        rates.append(nbytes / (start.elapsed_time(end) / 1000) / 1e9)
    return {"best_gbps": max(rates), "median_gbps": statistics.median(rates)}


def probe(gib: float, block_mib: list[float], repeats: int) -> list[dict[str, Any]]:
    import torch

    nbytes = int(gib * (1 << 30))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    out = [{"what": "h2d whole", "bytes": nbytes,
            **timed_gbps(lambda: dev.copy_(host, non_blocking=True), nbytes, repeats)},
           {"what": "d2h whole", "bytes": nbytes,
            **timed_gbps(lambda: host.copy_(dev, non_blocking=True), nbytes, repeats)}]  # fmt: skip
    for mib in block_mib:
        size = int(mib * (1 << 20))
        count = nbytes // size
        hs, ds = host[: count * size].view(count, size), dev[: count * size].view(count, size)

        def blocks(hs: Any = hs, ds: Any = ds, count: int = count) -> None:
            for i in range(count):
                ds[i].copy_(hs[i], non_blocking=True)

        out.append({"what": f"h2d blocks of {mib:g} MiB", "bytes": count * size, "blocks": count,
                    **timed_gbps(blocks, count * size, repeats)})  # fmt: skip
    out.append({"device": torch.cuda.get_device_name(0), "torch": torch.__version__})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--block-mib", type=lambda t: [float(v) for v in t.split(",")],
                   default=[2.0, 0.0625])  # fmt: skip
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    results = probe(args.gib, args.block_mib, args.repeats)
    for r in results:
        print(json.dumps(r), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
