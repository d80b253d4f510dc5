"""Load points run one after another, in this process or shared out over client processes."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import openai

from .client import LoadPoint, Progress, Target, _closed_loop, _open_loop, _show
from .report import _json_number, request_record
from .shards import _run_sharded
from .stats import RequestResult, Slo, summarize
from .workload import Workload

CLIENT_BOUND = 0.8
"""A client process busier than this (CPU over wall time) reads its chunks late: a point's gaps
are then partly the client's. The report says so (`client.bound`)."""


async def run_point(
    target: Target, workload: Workload, point: LoadPoint, *, show_progress: bool = True,
    processes: int = 1,
) -> list[RequestResult]:  # fmt: skip
    """Run one load point against `target`; every request's result, warm-up ones included.
    With `processes` > 1 (an open loop only), that many client processes share the schedule
    (and show no progress line)."""
    results, _ = await run_point_measured(
        target, workload, point, show_progress=show_progress, processes=processes
    )
    return results


def shard_urls(target: Target, replicas: Sequence[str], processes: int) -> list[str]:
    """The URL each client process sends to: `target.url` and the other `replicas` of the same
    server (e.g. router processes on other ports) in turn, so that every replica gets a client
    process of its own. More replicas than processes would leave some idle: refused."""
    urls = [target.url, *replicas]
    if len(urls) > processes:
        raise ValueError(f"{len(urls)} server URLs need at least as many client processes, "
                         f"not {processes}")  # fmt: skip
    return [urls[k % len(urls)] for k in range(processes)]


async def run_point_measured(
    target: Target, workload: Workload, point: LoadPoint, *, show_progress: bool = True,
    processes: int = 1, replicas: Sequence[str] = (),
) -> tuple[list[RequestResult], float]:  # fmt: skip
    """`run_point`, and the busiest client process's CPU time over its wall time while it sent
    and read (near 1.0: the client, not the server, set the pace of the chunks it read).
    `replicas`: more URLs of the same server, shared out by `shard_urls`."""
    urls = shard_urls(target, replicas, processes)
    if processes > 1:
        return await _run_sharded(target, workload, point, urls)
    progress = Progress(point.label, None)
    shower = asyncio.create_task(_show(progress)) if show_progress else None
    client = openai.AsyncOpenAI(
        base_url=target.url, api_key=target.api_key, max_retries=0, timeout=target.timeout_s
    )
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        loop = _closed_loop if point.arrival == "closed" else _open_loop
        results = await loop(client, target, workload, point, progress)
        return results, (time.process_time() - cpu) / (time.perf_counter() - wall)
    finally:
        await client.close()
        if shower is not None:
            shower.cancel()
            print("\r" + progress.line(), file=sys.stderr, flush=True)


async def run(
    target: Target, workload: Workload, points: Sequence[LoadPoint], slo: Slo,
    *, show_progress: bool = True, on_point: Callable[[dict[str, Any]], None] | None = None,
    processes: int = 1, replicas: Sequence[str] = (),
) -> list[dict[str, Any]]:  # fmt: skip
    """Every load point in turn: its parameters, summary, the load average and every request.
    `processes`: client processes per open-loop point (a closed loop always runs in this one,
    so it refuses `replicas`); `replicas`: see `shard_urls`."""
    reports = []
    for point in points:
        loadavg_before = list(os.getloadavg())
        n = processes if point.arrival != "closed" else 1
        results, busy = await run_point_measured(
            target, workload, point, show_progress=show_progress, processes=n,
            replicas=replicas,
        )  # fmt: skip
        report = {
            "label": point.label,
            "client": {"processes": n, "busiest_cpu_fraction": busy, "bound": busy >= CLIENT_BOUND},
            "point": {k: _json_number(v) for k, v in asdict(point).items()},
            "summary": summarize(results, slo),
            "loadavg_before": loadavg_before,
            "loadavg_after": list(os.getloadavg()),
            "requests": [request_record(r) for r in results],
        }
        reports.append(report)
        if on_point is not None:
            on_point(report)
    return reports
