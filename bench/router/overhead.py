"""The router's own cost: latency it adds per request, and requests per second on one core.

    .venv/bin/python -P bench/router/overhead.py [--seconds 10] [--out bench/router/results.json]

What runs: real etcd and NATS, the real router process (`python -P -m kvrail.router`, pinned to
one core with `taskset`), and a stand-in decode worker in this process. The stand-in is on
purpose: it registers like a decode worker and answers each `GenerateRequest` at once with its
`max_tokens` tokens, so the time measured is the router's (HTTP, tokenization, routing, NATS,
detokenization), not the model's. The baseline, measured in the same run, sends the same
`GenerateRequest`s straight to the stand-in over NATS, as the router does: router latency minus
baseline latency is the latency the router adds.

Phases: (1) sequential requests, one at a time (latency: p50/p99 of router and baseline);
(2) a closed loop with `--concurrency` clients for `--seconds` (throughput of one router core);
(3) the same with streamed completions of `--stream-tokens` tokens, one token event each
(tokens per second through the router, and its CPU time per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from kvrail.bus import connect
from kvrail.codec import decode
from kvrail.keys import PoolKeys
from kvrail.local.procs import ManagedProcess, free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import GenerateRequest, KvEvent, TokenEvent, TokenEventBatch, WorkerRecord
from kvrail.registry import Registry, etcd_client
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings

POOL = "bench-router"
KEYS = PoolKeys("default", POOL)
WORKER = "stub-0"
MODEL = "SmolLM2-135M-Instruct"
REPLY_TOKEN = 28_120  # " hello" in SmolLM2's vocabulary; any id works
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]


STAND_IN = {"per_token": False}  # phase 3 switches the stand-in to one event per token


async def stand_in_worker(nc: NatsClient) -> None:
    """Answer every request at once with `max_tokens` tokens in one event, then finish; with
    `STAND_IN["per_token"]`, in one event per token, as a decode worker sends them (at once
    here, not one per engine step)."""

    async def on_request(msg: Msg) -> None:
        request = decode(msg.data, GenerateRequest)
        n = request.sampling.max_tokens
        if not STAND_IN["per_token"]:
            tokens = (REPLY_TOKEN,) * n
            first = TokenEvent(
                request.request_id, 0, tokens, "length", worker_id=WORKER, prefill_mode="local"
            )
            await nc.publish(request.stream_subject, TokenEventBatch((first,)).encode())
            return
        for seq in range(n):
            event = TokenEvent(
                request.request_id, seq, (REPLY_TOKEN,), "length" if seq == n - 1 else None,
                worker_id=WORKER, prefill_mode="local" if seq == 0 else "",
            )  # fmt: skip
            await nc.publish(request.stream_subject, TokenEventBatch((event,)).encode())

    async def on_state(msg: Msg) -> None:
        await msg.respond(KvEvent(WORKER, 1, 0, cleared=True).encode())

    await nc.subscribe(KEYS.decode_requests(WORKER), cb=on_request)
    await nc.subscribe(KEYS.kv_state(WORKER), cb=on_state)


async def direct(nc: NatsClient, max_tokens: int) -> float:
    """The baseline: one GenerateRequest straight to the stand-in, as the router sends it."""
    started = time.perf_counter()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    request = GenerateRequest(
        request_id=uuid.uuid4().hex, token_ids=tuple(range(100, 140)), stream_subject=inbox,
        deadline_unix_s=time.time() + 30, sampling=SamplingParams(max_tokens=max_tokens),
    )  # fmt: skip
    await nc.publish(KEYS.decode_requests(WORKER), request.encode(), reply=inbox)
    decode((await sub.next_msg(timeout=10)).data, TokenEventBatch)
    await sub.unsubscribe()
    return time.perf_counter() - started


async def via_router(http: httpx.AsyncClient, max_tokens: int) -> float:
    started = time.perf_counter()
    reply = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
    })  # fmt: skip
    reply.raise_for_status()
    assert reply.json()["usage"]["completion_tokens"] == max_tokens
    return time.perf_counter() - started


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "mean_ms": 1000 * statistics.fmean(ordered),
    }


async def closed_loop(http: httpx.AsyncClient, concurrency: int, seconds: float) -> dict[str, Any]:
    stop_at = time.perf_counter() + seconds
    latencies: list[float] = []

    async def client() -> None:
        while time.perf_counter() < stop_at:
            latencies.append(await via_router(http, 16))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {"concurrency": concurrency, "seconds": elapsed,
            "requests_per_s": len(latencies) / elapsed, **summary(latencies)}  # fmt: skip


async def streamed(http: httpx.AsyncClient, max_tokens: int) -> int:
    """One streamed chat completion; returns the content chunks received."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    chunks = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                chunks += 1
    return chunks


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def streaming_loop(
    http: httpx.AsyncClient, pid: int, concurrency: int, seconds: float, max_tokens: int
) -> dict[str, Any]:
    """Phase 3: clients stream `max_tokens`-token completions, the stand-in sends one event per
    token; tokens/s delivered, and the share of its core the router used meanwhile (near 1: the
    router is the limit; well below: the clients or the stand-in are)."""
    STAND_IN["per_token"] = True
    stop_at = time.perf_counter() + seconds
    counts: list[int] = []

    async def client() -> None:
        while time.perf_counter() < stop_at:
            counts.append(await streamed(http, max_tokens))

    cpu_before, started = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu_before
    STAND_IN["per_token"] = False
    return {"concurrency": concurrency, "max_tokens": max_tokens, "seconds": elapsed,
            "requests": len(counts), "content_chunks": sum(counts),
            "tokens_per_s": sum(counts) / elapsed, "router_core_share": cpu / elapsed,
            "router_cpu_us_per_token": 1e6 * cpu / max(1, sum(counts))}  # fmt: skip


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvrail-bench-router-"))
    etcd = EtcdServer(work / "etcd", work / "etcd.log").start()
    nats = NatsServer(work / "nats", work / "nats.log").start()
    settings = Settings(pool=POOL, etcd_endpoints=(etcd.endpoint,), nats_url=nats.url)
    port = free_port()
    router: ManagedProcess | None = None
    try:
        nc = await connect(settings, "bench")
        etcd_c = etcd_client(settings)
        record = WorkerRecord(worker_id=WORKER, pod_uid="bench", incarnation=1, role="decode",
                              fingerprint="bench-fingerprint", is_ready=True, block_size=16,
                              max_model_len=4096)  # fmt: skip
        registration = await Registry(etcd_c, KEYS).register(record)
        await stand_in_worker(nc)
        env = {**os.environ, "KVRAIL_POOL": POOL, "KVRAIL_ETCD_ENDPOINTS": etcd.endpoint,
               "KVRAIL_NATS_URL": nats.url, "KVRAIL_HTTP_PORT": str(port),
               "KVRAIL_LOG_LEVEL": "WARNING"}  # fmt: skip
        pin = ["taskset", "-c", str(args.router_core)] if args.router_core >= 0 else []
        argv = [*pin, sys.executable, "-P", "-m", "kvrail.router"]
        router = ManagedProcess("router", argv, work / "router.log", env=env).start()
        ready = f"http://127.0.0.1:{port}/ready"  # off the loop: the lease keeper runs on it
        await asyncio.to_thread(router.wait_ready, lambda: _get(ready), 120, 0.2)
        limits = httpx.Limits(max_connections=args.concurrency * 2)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                     timeout=30) as http:  # fmt: skip
            for _ in range(50):  # warm up both paths
                await via_router(http, 16)
                await direct(nc, 16)
            base, routed = [], []
            for _ in range(args.requests):  # interleaved: both see the same machine noise
                base.append(await direct(nc, 16))
                routed.append(await via_router(http, 16))
            loop = await closed_loop(http, args.concurrency, args.seconds)
            pid = router.pid
            assert pid is not None
            stream = await streaming_loop(
                http, pid, args.concurrency, args.seconds, args.stream_tokens
            )
        await registration.close()
        await nc.close()
        await etcd_c.close()
        b, r = summary(base), summary(routed)
        machine = {
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "router_core": args.router_core,
        }  # fmt: skip
        sequential = {
            "baseline_nats_direct": b, "via_router": r,
            "added_p50_ms": r["p50_ms"] - b["p50_ms"], "added_p99_ms": r["p99_ms"] - b["p99_ms"],
        }  # fmt: skip
        return {
            "command": "python -P bench/router/overhead.py " + " ".join(sys.argv[1:]),
            "machine": machine, "sequential": sequential, "closed_loop": loop,
            "streaming": stream,
        }  # fmt: skip
    finally:
        if router is not None:
            router.stop()
        nats.stop()
        etcd.stop()


def _get(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per path")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--router-core", type=int, default=1, help="-1: do not pin")
    parser.add_argument("--stream-tokens", type=int, default=64, help="phase 3's completions")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
