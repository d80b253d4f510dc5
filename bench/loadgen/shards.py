"""Several client processes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import openai

from .client import LoadPoint, Progress, Target, _open_loop
from .stats import RequestResult
from .workload import Lengths, Workload

# One Python process streaming through `openai.AsyncOpenAI` spends about 0.3 ms of CPU per chunk
# (2-vCPU development VM, bench/studies/client/loadgen_cost.txt): at a few thousand chunks/s its
# core is full, chunks queue in its socket buffers and are read in bunches, and the server's ITL
# looks worse than it is. A sweep of 150 streams at 10 ms steps needs 15,000/s.
# `--client-processes N` splits an open loop's schedule round robin over N child processes
# (`python -P bench/loadgen --shard K`), which wait for one start time and send their requests at
# the same instants as one process would.


_PACKAGE_DIR = str(Path(__file__).resolve().parent)
"""Run as `python -P bench/loadgen --shard K` (its `__main__.py`)."""


def _workload_from(d: dict[str, Any]) -> Workload:
    lengths = {k: Lengths(**d[k]) if d[k] is not None else None
               for k in ("prompt_tokens", "output_tokens", "long_context_tokens")}  # fmt: skip
    return Workload(**{**d, **lengths})


async def _run_sharded(
    target: Target, workload: Workload, point: LoadPoint, urls: Sequence[str]
) -> tuple[list[RequestResult], float]:
    """Client process k sends its shard of the schedule to `urls[k]`."""
    if point.arrival == "closed":
        raise ValueError("several client processes need an open loop (a rate), not a concurrency")
    processes = len(urls)
    specs = [json.dumps({"target": {**asdict(target), "url": url}, "workload": asdict(workload),
                         "point": asdict(point), "processes": processes})
             for url in urls]  # fmt: skip
    pipe = asyncio.subprocess.PIPE
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-P", _PACKAGE_DIR, "--shard", str(k), stdin=pipe, stdout=pipe
        )
        for k in range(processes)
    ]
    try:
        for child, spec in zip(children, specs, strict=True):
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(spec.encode() + b"\n")
            await child.stdin.drain()
        for child in children:  # each has imported openai and built its client
            assert child.stdout is not None
            if (await child.stdout.readline()).strip() != b"ready":
                code = await child.wait()
                raise RuntimeError(f"client process {child.pid} did not start (exit {code})")
        start = time.perf_counter() + 0.05
        for child in children:
            assert child.stdin is not None
            child.stdin.write(f"{start!r}\n".encode())
            await child.stdin.drain()
        # Not `communicate()`, which would close their stdin now: its end tells a client
        # process that this one is gone (`_end_at_eof`).
        outputs = await asyncio.gather(*(_output(child) for child in children))
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
            if child.stdin is not None:
                child.stdin.close()
    results: list[RequestResult] = []
    busiest = 0.0
    for child, out in zip(children, outputs, strict=True):
        if child.returncode != 0:
            raise RuntimeError(f"client process {child.pid} exited with {child.returncode}")
        report = json.loads(out)
        results += [RequestResult(**r) for r in report["results"]]
        busiest = max(busiest, report["busy"])
    return sorted(results, key=lambda r: r.index), busiest


async def _output(child: asyncio.subprocess.Process) -> bytes:
    """A client process's whole stdout, once it has exited."""
    assert child.stdout is not None
    out = await child.stdout.read()
    await child.wait()
    return out


def _end_at_eof() -> None:
    """A client process's stdin stays open while `_run_sharded` waits for it. Its end means the
    load generator that started this process is gone (killed, SIGKILL included), so this one
    ends too, whatever it still has in flight."""
    sys.stdin.read()
    os._exit(3)


async def _shard_main(shard: int) -> None:
    """A child of `_run_sharded`: the spec on stdin, "ready", the start time on stdin, then its
    requests' results and its CPU over wall time as one JSON object on stdout."""
    loop = asyncio.get_running_loop()
    spec = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    target, point = Target(**spec["target"]), LoadPoint(**spec["point"])
    workload = _workload_from(spec["workload"])
    client = openai.AsyncOpenAI(
        base_url=target.url, api_key=target.api_key, max_retries=0, timeout=target.timeout_s
    )
    print("ready", flush=True)
    start = float(await loop.run_in_executor(None, sys.stdin.readline))
    threading.Thread(target=_end_at_eof, name="end-at-eof", daemon=True).start()
    progress = Progress(point.label, None)
    cpu = time.process_time()
    try:
        results = await _open_loop(client, target, workload, point, progress,
                                   (shard, spec["processes"]), start)  # fmt: skip
        busy = (time.process_time() - cpu) / (time.perf_counter() - start)
    finally:
        await client.close()
    print(json.dumps({"results": [asdict(r) for r in results], "busy": busy}), flush=True)
