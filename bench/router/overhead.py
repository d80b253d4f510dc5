"""The router's own cost: latency it adds per request, and requests per second on one core.

    .venv/bin/python -P bench/router/overhead.py [--seconds 10] [--out bench/router/results.json]

What runs: real etcd and NATS, the real router process (`python -P -m kvrail.router`, pinned to
one core with `taskset`), and a stand-in decode worker in this process (pinned, with the
clients, etcd and NATS, to the other core). The clients speak HTTP/1.1 through `lean_http`, not
httpx, whose own cost per request is larger than the router's (`lean_http` says by how much).
The stand-in is on purpose: it registers like a decode worker and answers each
`GenerateRequest` at once with its `max_tokens` tokens, so the time measured is the router's
(HTTP, tokenization, routing, NATS, detokenization), not the model's. The baseline, measured
in the same run, sends the same `GenerateRequest`s straight to the stand-in over NATS, as the
router does: router latency minus baseline latency is the latency the router adds.

Phases: (1) sequential requests, one at a time (latency: p50/p99 of router and baseline);
(2) a closed loop with `--concurrency` clients for `--seconds` (throughput of one router core);
(3) the same with streamed completions of `--stream-tokens` tokens, the stand-in sending them
as a decode worker does, one token per request per step in one `TokenEventBatch` per step
(requests and tokens per second through the router, and its CPU time per request and token).
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
from kvrail.messages import GenerateRequest, KvEvent, WorkerRecord
from kvrail.outputs import MAX_EVENTS_PER_BATCH, RequestOutput, TokenEvent, TokenEventBatch
from kvrail.registry import Registry, etcd_client
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings

sys.path.insert(0, str(Path(__file__).parent))
from lean_http import Connection

POOL = "bench-router"
KEYS = PoolKeys("default", POOL)
WORKER = "stub-0"
MODEL = "SmolLM2-135M-Instruct"
REPLY_TOKEN = 28_120  # " hello" in SmolLM2's vocabulary; any id works
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]


STAND_IN = {"stepped": False}  # phase 3 switches the stand-in to engine steps


class Steps:
    """Phase 3's stand-in engine: every step, one `TokenEventBatch` per router with the next
    token of each running request, as a decode worker publishes a step (here as fast as this
    core allows, `step_s` apart)."""

    def __init__(self, nc: NatsClient, step_s: float) -> None:
        self.nc = nc
        self.step_s = step_s
        self.running: dict[str, tuple[str, int, int]] = {}  # id -> (subject, max_tokens, seq)
        self.wake = asyncio.Event()
        self.num_steps = 0
        self.num_events = 0

    def add(self, request: GenerateRequest) -> None:
        self.running[request.request_id] = (request.stream_subject, request.sampling.max_tokens, 0)
        self.wake.set()

    async def run(self) -> None:
        while True:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
            batches: dict[str, list[TokenEvent]] = {}
            for rid, (subject, n, seq) in list(self.running.items()):
                last = seq == n - 1
                output = RequestOutput(rid, (REPLY_TOKEN,), "length" if last else None)
                batches.setdefault(subject, []).append(
                    TokenEvent(output, seq, WORKER, prefill_mode="local" if seq == 0 else "")
                )
                if last:
                    del self.running[rid]
                else:
                    self.running[rid] = (subject, n, seq + 1)
            for subject, events in batches.items():
                for at in range(0, len(events), MAX_EVENTS_PER_BATCH):
                    chunk = tuple(events[at : at + MAX_EVENTS_PER_BATCH])
                    await self.nc.publish(subject, TokenEventBatch(chunk).encode())
                self.num_events += len(events)
            self.num_steps += 1
            await asyncio.sleep(self.step_s)


async def stand_in_worker(nc: NatsClient, steps: Steps) -> None:
    """Answer every request at once with `max_tokens` tokens in one event, then finish; with
    `STAND_IN["stepped"]`, hand it to `steps`, which sends one token per step."""

    async def on_request(msg: Msg) -> None:
        request = decode(msg.data, GenerateRequest)
        if STAND_IN["stepped"]:
            steps.add(request)
            return
        tokens = (REPLY_TOKEN,) * request.sampling.max_tokens
        output = RequestOutput(request.request_id, tokens, "length")
        first = TokenEvent(output, 0, WORKER, prefill_mode="local")
        await nc.publish(request.stream_subject, TokenEventBatch((first,)).encode())

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


def chat_body(max_tokens: int, stream: bool = False) -> bytes:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps({**body, **streamed} if stream else body).encode()


async def via_router(conn: Connection, max_tokens: int) -> float:
    started = time.perf_counter()
    status, body = await conn.post("/v1/chat/completions", chat_body(max_tokens))
    if status != 200:
        raise RuntimeError(f"router answered {status}: {body[:200]!r}")
    assert json.loads(body)["usage"]["completion_tokens"] == max_tokens
    return time.perf_counter() - started


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "mean_ms": 1000 * statistics.fmean(ordered),
    }


async def closed_loop(port: int, pid: int, concurrency: int, seconds: float) -> dict[str, Any]:
    """Phase 2: non-streamed completions, `concurrency` at a time; requests per second and the
    router's CPU time per request (the core share near 1: the router is the limit)."""
    stop_at = time.perf_counter() + seconds
    latencies: list[float] = []

    async def client() -> None:
        conn = await Connection.open("127.0.0.1", port)
        while time.perf_counter() < stop_at:
            latencies.append(await via_router(conn, 16))
        await conn.close()

    cpu_before, started = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu_before
    return {"concurrency": concurrency, "seconds": elapsed,
            "requests_per_s": len(latencies) / elapsed, "router_core_share": cpu / elapsed,
            "router_cpu_us_per_request": 1e6 * cpu / max(1, len(latencies)),
            **summary(latencies)}  # fmt: skip


async def streamed(conn: Connection, max_tokens: int) -> int:
    """One streamed chat completion; returns the chunks received that carry text (not the
    first, which carries the role). A chunk may carry several tokens (a stream that fell behind
    catches up in one); the usage chunk must count all `max_tokens`."""
    chunks = tokens = 0
    async for event in conn.post_events("/v1/chat/completions", chat_body(max_tokens, True)):
        if event.startswith(b"data: {") and b'"content":"' in event:
            chunks += b'"content":""' not in event
        if event.startswith(b"data: {") and b'"completion_tokens"' in event:
            tokens = json.loads(event[6:])["usage"]["completion_tokens"]
    if tokens != max_tokens:
        raise RuntimeError(f"a stream delivered {tokens} tokens, not {max_tokens}")
    return chunks


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def streaming_loop(
    port: int, pid: int, steps: Steps, concurrency: int, seconds: float, max_tokens: int
) -> dict[str, Any]:
    """Phase 3: clients stream `max_tokens`-token completions, the stand-in sends a token per
    request per step (`Steps`); requests and tokens per second delivered, and the share of its
    core the router used meanwhile (near 1: the router is the limit; well below: the clients or
    the stand-in are)."""
    STAND_IN["stepped"] = True
    stop_at = time.perf_counter() + seconds
    counts: list[int] = []  # text chunks per request

    async def client() -> None:
        conn = await Connection.open("127.0.0.1", port)
        while time.perf_counter() < stop_at:
            counts.append(await streamed(conn, max_tokens))
        await conn.close()

    steps_before = steps.num_steps
    cpu_before, started = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu_before
    STAND_IN["stepped"] = False
    num_steps = steps.num_steps - steps_before
    tokens = len(counts) * max_tokens  # each stream's usage said so (`streamed`)
    return {"concurrency": concurrency, "max_tokens": max_tokens, "seconds": elapsed,
            "requests": len(counts), "requests_per_s": len(counts) / elapsed,
            "content_chunks": sum(counts), "tokens_per_s": tokens / elapsed,
            "steps": num_steps, "events_per_step": tokens / max(1, num_steps),
            "router_core_share": cpu / elapsed,
            "router_cpu_us_per_request": 1e6 * cpu / max(1, len(counts)),
            "router_cpu_us_per_token": 1e6 * cpu / max(1, tokens)}  # fmt: skip


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
        steps = Steps(nc, args.step_ms / 1000)
        stepping = asyncio.create_task(steps.run())
        await stand_in_worker(nc, steps)
        env = {**os.environ, "KVRAIL_POOL": POOL, "KVRAIL_ETCD_ENDPOINTS": etcd.endpoint,
               "KVRAIL_NATS_URL": nats.url, "KVRAIL_HTTP_PORT": str(port),
               "KVRAIL_LOG_LEVEL": "WARNING"}  # fmt: skip
        pin = ["taskset", "-c", str(args.router_core)] if args.router_core >= 0 else []
        argv = [*pin, sys.executable, "-P", "-m", "kvrail.router"]
        router = ManagedProcess("router", argv, work / "router.log", env=env).start()
        ready = f"http://127.0.0.1:{port}/ready"  # off the loop: the lease keeper runs on it
        await asyncio.to_thread(router.wait_ready, lambda: _get(ready), 120, 0.2)
        conn = await Connection.open("127.0.0.1", port)
        for _ in range(50):  # warm up both paths
            await via_router(conn, 16)
            await direct(nc, 16)
        base, routed = [], []
        for _ in range(args.requests):  # interleaved: both see the same machine noise
            base.append(await direct(nc, 16))
            routed.append(await via_router(conn, 16))
        await conn.close()
        pid = router.pid
        assert pid is not None
        loop = await closed_loop(port, pid, args.concurrency, args.seconds)
        stream = await streaming_loop(
            port, pid, steps, args.concurrency, args.seconds, args.stream_tokens
        )
        stepping.cancel()
        await registration.close()
        await nc.close()
        await etcd_c.close()
        b, r = summary(base), summary(routed)
        machine = {
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "router_core": args.router_core,
            "client_core": args.client_core,
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
    parser.add_argument("--client-core", type=int, default=0,
                        help="this process, etcd and NATS (-1: do not pin)")  # fmt: skip
    parser.add_argument("--stream-tokens", type=int, default=16, help="phase 3's completions")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="phase 3: the stand-in's pause between steps")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()
    if args.client_core >= 0:  # inherited by etcd and NATS, which this process starts
        os.sched_setaffinity(0, {args.client_core})
    result = asyncio.run(main_async(args))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
