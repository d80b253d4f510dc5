"""What one more descriptor costs a NIXL write, and whether descriptor lists prepared once
(`prep_xfer_dlist` + `make_prepped_xfer`) make it cheaper: the question behind issue 49's
layer groups, which are one descriptor per block (docs/layerwise.md).

Two agents in this process, UCX, one registered region each; writes of N descriptors of S bytes
(every other S-byte slot, so no two are adjacent), N = 1, 128, 512, 2048, each timed in three
parts per descriptor: building the descriptor lists, `initialize_xfer` (or `make_prepped_xfer`
over lists prepared once), and the transfer to DONE. Median of `--iters` after one untimed.
The same total bytes in one descriptor is the reference for what the bytes alone cost.

Here (DRAM): .venv/bin/python -P bench/transfer/nixl_descriptors.py
On the lent GPU (VRAM; carry .whl): source hack/device-env.sh &&
    python3 -P bench/transfer/nixl_descriptors.py --device cuda [--busy default|side]

`--busy` keeps the GPU computing while the writes run, as a prefill does while a layer group
is written (issue 49's writes during the prefill cost 100-200 us a descriptor on the H100 and
after it almost nothing): back-to-back bf16 matmuls, a few queued at a time, on torch's default
stream (where kvrail's engine computes) or on a stream of their own (non-blocking). The same
cost under both says the copies wait for the GPU's SMs; a cost under `default` only says they
are ordered behind the engine's stream.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

COUNTS = (1, 128, 512, 2048)


def _nixl() -> Any:
    try:
        import nixl._api as api
    except ImportError:
        import nixl_cu12._api as api
    return api


def _done(agent: Any, handle: Any) -> None:
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    assert state == "DONE", state
    agent.release_xfer_handle(handle)


def _median(fn: Callable[[], tuple[float, ...]], iters: int) -> tuple[float, ...]:
    fn()  # untimed
    runs = [fn() for _ in range(iters)]
    return tuple(statistics.median(r[i] for r in runs) for i in range(len(runs[0])))


@contextlib.contextmanager
def _busy(where: str) -> Iterator[None]:
    """Back-to-back matmuls on the GPU (`where`: torch's default stream, or a side stream)
    until the block ends; nothing when `where` is none."""
    if where == "none":
        yield
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.default_stream() if where == "default" else torch.cuda.Stream()
    stop = threading.Event()

    def spin() -> None:
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for _ in range(4):  # a few queued, like a prefill's layers
                    a @ a
                stream.synchronize()

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        yield
    finally:
        stop.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[256, 65536, 524288])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--busy", default="none", choices=["none", "default", "side"])
    args = parser.parse_args()
    if args.busy != "none" and args.device != "cuda":
        parser.error("--busy needs --device cuda")
    api = _nixl()
    cfg = api.nixl_agent_config(backends=["UCX"])
    writer, reader = api.nixl_agent("writer", cfg), api.nixl_agent("reader", cfg)
    mem = "VRAM" if args.device == "cuda" else "DRAM"
    dev = 0
    total = max(COUNTS) * max(args.sizes) * 2
    src = torch.ones(total, dtype=torch.uint8, device=args.device)
    dst = torch.zeros_like(src)
    writer.register_memory(src)
    reader.register_memory(dst)
    writer.add_remote_agent(reader.get_agent_metadata())
    reader.add_remote_agent(writer.get_agent_metadata())
    print(f"# NIXL, UCX, {mem}, two agents in one process; microseconds per descriptor, "
          f"median of {args.iters}; GPU busy: {args.busy}")  # fmt: skip
    with _busy(args.busy):
        _table(args, writer, src, dst, mem, dev)


def _table(args: argparse.Namespace, writer: Any, src: Any, dst: Any, mem: str, dev: int) -> None:
    for size in args.sizes:

        def ranges(base: int, n: int, size: int = size) -> list[tuple[int, int, int]]:
            return [(base + i * 2 * size, size, dev) for i in range(n)]

        def plain(n: int, size: int = size) -> tuple[float, ...]:
            t0 = time.perf_counter()
            s = writer.get_xfer_descs(ranges(src.data_ptr(), n), mem)
            d = writer.get_xfer_descs(ranges(dst.data_ptr(), n), mem)
            t1 = time.perf_counter()
            handle = writer.initialize_xfer("WRITE", s, d, "reader", b"")
            t2 = time.perf_counter()
            _done(writer, handle)
            t3 = time.perf_counter()
            return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6, (t3 - t2) / n * 1e6

        def one(n: int, size: int = size) -> tuple[float, ...]:  # the same bytes, one range
            s = writer.get_xfer_descs([(src.data_ptr(), n * size, dev)], mem)
            d = writer.get_xfer_descs([(dst.data_ptr(), n * size, dev)], mem)
            t0 = time.perf_counter()
            _done(writer, writer.initialize_xfer("WRITE", s, d, "reader", b""))
            return ((time.perf_counter() - t0) / n * 1e6,)

        local = writer.prep_xfer_dlist("NIXL_INIT_AGENT", ranges(src.data_ptr(), max(COUNTS)), mem)
        remote = writer.prep_xfer_dlist("reader", ranges(dst.data_ptr(), max(COUNTS)), mem)

        def prepped(n: int, local: Any = local, remote: Any = remote) -> tuple[float, ...]:
            ids = list(range(n))
            t1 = time.perf_counter()
            handle = writer.make_prepped_xfer("WRITE", local, ids, remote, ids, b"")
            t2 = time.perf_counter()
            _done(writer, handle)
            t3 = time.perf_counter()
            return (t2 - t1) / n * 1e6, (t3 - t2) / n * 1e6

        print(f"\n## descriptors of {size} bytes")
        print(f"{'N':>5} {'lists':>8} {'init':>8} {'xfer':>8} | {'prepped init':>12} "
              f"{'xfer':>8} | {'one range, same bytes':>21}")  # fmt: skip
        for n in COUNTS:
            p = _median(lambda n=n: plain(n), args.iters)
            q = _median(lambda n=n: prepped(n), args.iters)
            r = _median(lambda n=n: one(n), args.iters)
            print(f"{n:5d} {p[0]:8.2f} {p[1]:8.2f} {p[2]:8.2f} | {q[0]:12.2f} {q[1]:8.2f} | "
                  f"{r[0]:21.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
