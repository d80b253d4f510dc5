"""Where the serving stack's time goes: one engine, three ways of driving it, the same requests.

    .venv/bin/python -P bench/serving/run.py --out bench/serving/cpu.json        # CPU, minutes
    source hack/device-env.sh && source bench/sweep/device-setup.sh                # lent H200
    python3 -P bench/serving/run.py --device cuda --shape llama3-8b --out $OUT/h200.json

For each concurrency N (`--concurrency`, default 1,32,256), N requests of `--prompt-tokens`
prompt and enough output tokens to stay decoding through the window, greedy, no EOS:

- `engine`: `LLMEngine.step()` in a loop once every request decodes: output tokens per second
  (N per step) over `--steps` steps;
- `service`: the same engine behind `EngineService` (the worker's engine thread), each update
  taken on the event loop by a callback that builds and encodes its `TokenEvent`, as the decode
  role does before publishing it: tokens per second from the median gap between a request's
  updates;
- `stack`: a real colocated worker process on the same model directory and settings, the real
  router, real etcd and NATS, and N streaming HTTP clients (chat completions with
  `ignore_eos`), in this process or spread over `--client-procs` processes (one Python process
  tops out near 22,000 streamed tokens a second): tokens per second delivered to the clients
  while all N stream (from the moment the last one got its first chunk to the moment the first
  one finished), TTFT and inter-chunk gaps, and each process's CPU seconds over that window,
  per token (where the stack's time goes; the machine's cores bound their sum).

The model (`bench/sweep/model.py`) has random weights and a synthetic word-level tokenizer: every
generated token is one streamed chunk. `--shape tiny` on the CPU keeps the model's own time
small, so what is measured is the stack's; `llama3-8b` on the H200 is the issue's shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool
from kvrail.testing.scripts import load_script

HERE = Path(__file__).resolve().parent
lg = load_script("kvrail_bench_loadgen", HERE.parent / "loadgen" / "__init__.py")
randmodel = load_script("kvrail_bench_sweep_model", HERE.parent / "sweep" / "model.py")
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Plan:
    device: str
    shape: str
    concurrency: tuple[int, ...]
    prompt_tokens: int
    steps: int
    kv_blocks: int
    modes: tuple[str, ...]
    threads: int | None
    routers: int = 1
    client_procs: int = 1
    """Processes the stack's clients are spread over (1: this one). One Python process tops out
    near 22,000 streamed tokens a second (about 46 us each), below the H100's rate at 256."""

    @property
    def output_tokens(self) -> int:
        # Long enough that every request still decodes while the last ones get their first
        # token and `steps` more: the window in which all N stream.
        return self.steps * 3 + 64

    @property
    def max_model_len(self) -> int:
        return self.prompt_tokens + self.output_tokens + 64

    def worker_env(self) -> dict[str, str]:
        env = {
            "KVRAIL_NUM_KV_BLOCKS": str(self.kv_blocks),
            "KVRAIL_MAX_NUM_SEQS": str(max(self.concurrency)),
            "KVRAIL_MAX_MODEL_LEN": str(self.max_model_len),
            "KVRAIL_MAX_NUM_BATCHED_TOKENS": "8192",
            "KVRAIL_DISAGGREGATION_MODE": "colocated",
        }
        if self.threads:
            env["KVRAIL_TORCH_NUM_THREADS"] = str(self.threads)
        return env


def prompt_words(n: int, length: int) -> list[str]:
    """N prompts of `length` - 2 load-generator words (with the role markers: `length` tokens),
    each different from its first word on (no prefix is shared)."""
    words = lg.WORDS
    return [
        " ".join(words[(i * 7919 + j * 31) % len(words)] for j in range(length - 2))
        for i in range(n)
    ]


# -- engine and service -----------------------------------------------------------------------


def build_engine(plan: Plan, model_dir: Path) -> Any:
    import torch

    from kvrail.worker.engine.config import EngineConfig
    from kvrail.worker.engine.engine import LLMEngine

    if plan.threads:
        torch.set_num_threads(plan.threads)
    config = EngineConfig(
        num_blocks=plan.kv_blocks, block_size=BLOCK_SIZE, max_model_len=plan.max_model_len,
        max_num_seqs=max(plan.concurrency), max_num_batched_tokens=8192,
    )  # fmt: skip
    dtype = torch.bfloat16 if plan.device == "cuda" else torch.float32
    return LLMEngine.from_source(str(model_dir), config, dtype=dtype, device=plan.device)


def token_prompts(engine: Any, n: int, length: int) -> list[list[int]]:
    tokenizer = engine.tokenizer
    chat = "<|user|> {} <|assistant|>"
    return [tokenizer.encode(chat.format(w), add_special_tokens=False) for w in
            prompt_words(n, length)]  # fmt: skip


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def engine_tokens_per_s(engine: Any, plan: Plan, n: int) -> dict[str, float]:
    from kvrail.sampling import SamplingParams

    params = SamplingParams(max_tokens=plan.output_tokens, ignore_eos=True)
    requests = [
        engine.add_request(f"e{n}-{i}", p, params)
        for i, p in enumerate(token_prompts(engine, n, plan.prompt_tokens))
    ]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    sync(plan.device)
    started = time.perf_counter()
    for _ in range(plan.steps):
        engine.step()
    sync(plan.device)
    step_s = (time.perf_counter() - started) / plan.steps
    for r in requests:
        engine.abort(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {"ms_per_step": 1000 * step_s, "output_tokens_per_s": n / step_s}


async def service_tokens_per_s(engine: Any, plan: Plan, n: int) -> dict[str, float]:
    from kvrail.outputs import RequestOutput, TokenEvent
    from kvrail.sampling import SamplingParams
    from kvrail.worker.service import EngineService

    params = SamplingParams(max_tokens=plan.output_tokens, ignore_eos=True)
    service = EngineService(engine, asyncio.get_running_loop()).start()
    seqs: dict[str, int] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    enough = asyncio.Event()
    all_started = float("inf")

    def on_update(update: RequestOutput) -> None:  # the decode role's work, minus publishing
        nonlocal all_started
        now = time.perf_counter()
        rid = update.request_id
        seq = seqs.get(rid, 0)
        seqs[rid] = seq + 1
        TokenEvent(update, seq, "w").encode()
        if len(seqs) == n and all_started == float("inf"):
            all_started = now
        if last.get(rid, 0.0) >= all_started:
            gaps.append(now - last[rid])
            if len(gaps) >= plan.steps * n:
                enough.set()
        last[rid] = now

    try:
        prompts = token_prompts(engine, n, plan.prompt_tokens)
        await asyncio.gather(*(service.submit(f"s{n}-{i}", p, params, on_update)
                               for i, p in enumerate(prompts)))  # fmt: skip
        await asyncio.wait_for(enough.wait(), 1800)
    finally:
        await service.close()
    gap_s = statistics.median(gaps)
    return {"ms_per_token": 1000 * gap_s, "output_tokens_per_s": n / gap_s}


# -- the full stack ---------------------------------------------------------------------------


@dataclass(slots=True)
class Stream:
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    error: str = ""


async def stream_one(http: httpx.AsyncClient, body: dict[str, Any], out: Stream) -> None:
    out.sent = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                # a token's chunk: not the role chunk sent at once (`"content":""`), which
                # counted as each stream's first token and put the prefills inside the window
                token = '"content":"' in line and '"content":""' not in line
                if token and line.startswith('data: {"id"'):
                    out.chunks.append(time.perf_counter())
    except httpx.HTTPError as err:
        out.error = type(err).__name__


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


Streams = tuple[list[tuple[int, Stream]], list[tuple[float, float]]]


async def client_streams(
    ports: list[int], jobs: list[tuple[int, dict[str, Any]]], per_router: int, start_at: float
) -> Streams:
    """One client process's share of the streams (stream i to router i mod K, as a Service
    spreads connections over replicas): their `Stream`s by index, and the process's CPU
    seconds sampled every 50 ms. Starts at `start_at`, a `perf_counter` time (CLOCK_MONOTONIC:
    the same clock in every process of the machine)."""
    samples: list[tuple[float, float]] = []

    async def sample_cpu() -> None:
        while True:
            samples.append((time.perf_counter(), time.process_time()))
            await asyncio.sleep(0.05)

    limits = httpx.Limits(max_connections=per_router, max_keepalive_connections=per_router)
    clients = [
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=1800)
        for port in ports
    ]
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    sampler = asyncio.create_task(sample_cpu())
    streams = [(i, Stream()) for i, _ in jobs]
    try:
        await asyncio.gather(
            *(stream_one(clients[i % len(clients)], body, out)
              for (i, body), (_, out) in zip(jobs, streams, strict=True))
        )  # fmt: skip
    finally:
        for client in clients:
            await client.aclose()
        sampler.cancel()
    samples.append((time.perf_counter(), time.process_time()))
    return streams, samples


def _client_process(*args: Any) -> Streams:
    """`client_streams` in a client process of its own."""
    return asyncio.run(client_streams(*args))


def _cpu_us_per_token(
    samples: Sequence[tuple[float, float]], start: float, end: float, tokens: int
) -> float | None:
    """A process's CPU microseconds per token over the window [start, end], from its
    (time, CPU seconds) samples: the CPU between the first and last sample inside the window,
    scaled to the whole window; None with fewer than two samples inside."""
    inside = [(t, c) for t, c in samples if start <= t <= end]
    if len(inside) < 2:
        return None
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    share = (t1 - t0) / (end - start) if end > start else 0.0
    return (c1 - c0) / max(tokens * share, 1) * 1e6


async def stack_tokens_per_s(
    pool: LocalPool, ports: list[int], plan: Plan, n: int, pids: dict[str, int]
) -> dict[str, Any]:
    bodies = [{"model": "bench", "max_tokens": plan.output_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True,
               "messages": [{"role": "user", "content": words}]}
              for words in prompt_words(n, plan.prompt_tokens)]  # fmt: skip
    per_router = -(-n // len(ports)) + 8
    cpu_marks: list[tuple[float, dict[str, float]]] = []
    procs = max(1, min(plan.client_procs, n))

    async def sample_cpu() -> None:
        while True:
            cpu_marks.append((time.perf_counter(), {k: cpu_seconds(p) for k, p in pids.items()}))
            await asyncio.sleep(0.05)

    groups = [[(i, b) for i, b in enumerate(bodies) if i % procs == p] for p in range(procs)]
    sampler = asyncio.create_task(sample_cpu())
    try:
        if procs == 1:  # in this process, on this loop
            results = [await client_streams(ports, groups[0], per_router, 0.0)]
        else:
            with multiprocessing.get_context("spawn").Pool(procs) as workers:
                workers.map(_warm, range(procs))  # every process started and imported
                start_at = time.perf_counter() + 0.3
                pending = [
                    workers.apply_async(_client_process, (ports, group, per_router, start_at))
                    for group in groups
                ]
                results = [await asyncio.to_thread(r.get) for r in pending]
    finally:
        sampler.cancel()
    by_index = {i: out for done, _ in results for i, out in done}
    streams = [by_index[i] for i in range(n)]
    client_samples = [samples for _, samples in results]
    errors = [s.error for s in streams if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed: {sorted(set(errors))}")
    window_start = max(s.chunks[0] for s in streams)
    window_end = min(s.chunks[-1] for s in streams)
    tokens = sum(1 for s in streams for t in s.chunks if window_start < t <= window_end)
    window = window_end - window_start
    gaps = [b - a for s in streams for a, b in zip(s.chunks, s.chunks[1:], strict=False)
            if window_start < b <= window_end]  # fmt: skip
    per_token = {
        k: _cpu_us_per_token([(t, c[k]) for t, c in cpu_marks], window_start, window_end, tokens)
        for k in pids
    }
    # the clients' CPU from each client process's own samples (this process's, with one)
    clients = [_cpu_us_per_token(c, window_start, window_end, tokens) for c in client_samples]
    per_token["clients"] = None if None in clients else sum(c for c in clients if c is not None)
    cpu = {k: v for k, v in per_token.items() if v is not None}
    return {
        "output_tokens_per_s": tokens / window if window > 0 else 0.0,
        "window_s": window, "window_tokens": tokens, "client_procs": procs,
        "ttft_p50_ms": 1000 * statistics.median(s.chunks[0] - s.sent for s in streams),
        "ttft_p99_ms": 1000 * _pct([s.chunks[0] - s.sent for s in streams], 0.99),
        "chunk_gap_p50_ms": 1000 * _pct(gaps, 0.5), "chunk_gap_p99_ms": 1000 * _pct(gaps, 0.99),
        "chunk_gap_max_ms": 1000 * max(gaps, default=0.0),
        "cpu_us_per_token": cpu,
    }  # fmt: skip


def _warm(_: int) -> None:
    """Nothing: mapping it over a pool makes every process start (and import) before the
    timed streams."""


def start_stack(
    plan: Plan, model_dir: Path, work: Path
) -> tuple[LocalPool, list[int], dict[str, int]]:
    etcd = EtcdServer(work / "etcd", work / "logs" / "etcd.log").start()
    nats = NatsServer(work / "nats", work / "logs" / "nats.log").start()
    ports = [free_port() for _ in range(plan.routers)]
    env = {"KVRAIL_MODEL": str(model_dir), "KVRAIL_CACHE_DIR": str(work / "cache"),
           "KVRAIL_SERVED_MODEL_NAME": "bench", **plan.worker_env()}  # fmt: skip
    if plan.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    pool = LocalPool(etcd, nats, work / "logs", "serving", env)
    pool.start("worker-0", "colocated")
    pool.wait_ready("worker-0", timeout_s=900)
    for i, port in enumerate(ports):
        pool.start_router(f"router-{i}", KVRAIL_HTTP_PORT=str(port))
    for i in range(len(ports)):
        pool.wait_ready(f"router-{i}")
    pids = {
        "worker": pool.procs["worker-0"].pid or 0,
        **{f"router-{i}": pool.procs[f"router-{i}"].pid or 0 for i in range(len(ports))},
        "nats": nats.process.pid if nats.process and nats.process.pid else 0,
    }  # fmt: skip
    pool.servers = (etcd, nats)  # type: ignore[attr-defined]
    return pool, ports, pids


def stop_stack(pool: LocalPool) -> None:
    pool.stop()
    for server in getattr(pool, "servers", ()):
        server.stop()


# -- the run ----------------------------------------------------------------------------------


def run(plan: Plan, work: Path) -> dict[str, Any]:
    model_dir = work / f"model-{plan.shape}"
    info = randmodel.write_model_dir(model_dir, plan.shape, lg.WORDS, device=plan.device)
    result: dict[str, Any] = {"plan": asdict(plan), "model": info, "points": []}
    engine = build_engine(plan, model_dir) if {"engine", "service"} & set(plan.modes) else None
    if engine is not None:  # warm up (Triton compiles, CUDA graphs capture)
        engine_tokens_per_s(engine, replace(plan, steps=4), 2)
    stack = start_stack(plan, model_dir, work) if "stack" in plan.modes else None
    try:
        if stack is not None:  # warm up the worker the same way
            asyncio.run(stack_tokens_per_s(stack[0], stack[1], replace(plan, steps=4), 2,
                                           stack[2]))  # fmt: skip
        for n in plan.concurrency:
            point: dict[str, Any] = {"concurrency": n}
            if engine is not None and "engine" in plan.modes:
                point["engine"] = engine_tokens_per_s(engine, plan, n)
            if engine is not None and "service" in plan.modes:
                point["service"] = asyncio.run(service_tokens_per_s(engine, plan, n))
            if stack is not None:
                point["stack"] = asyncio.run(stack_tokens_per_s(stack[0], stack[1], plan, n,
                                                                stack[2]))  # fmt: skip
            base = point.get("engine", {}).get("output_tokens_per_s")
            for mode in ("service", "stack"):
                if base and mode in point:
                    point[mode]["of_engine"] = point[mode]["output_tokens_per_s"] / base
            result["points"].append(point)
            print(json.dumps(point), flush=True)
    finally:
        if stack is not None:
            stop_stack(stack[0])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", default="tiny", choices=sorted(randmodel.SHAPES))
    parser.add_argument("--concurrency", default="1,32,256")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per point")
    parser.add_argument("--kv-blocks", type=int, default=0, help="0: enough for every request")
    parser.add_argument("--modes", default="engine,service,stack")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--routers", type=int, default=1, help="router processes (replicas)")
    parser.add_argument("--client-procs", type=int, default=1,
                        help="processes the stack's clients are spread over")  # fmt: skip
    parser.add_argument("--work", type=Path, help="model dir and logs (default: a temp dir)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    concurrency = tuple(int(c) for c in args.concurrency.split(","))
    steps = args.steps
    per_request = -(-(args.prompt_tokens + steps * 3 + 64 + 64) // BLOCK_SIZE)
    kv_blocks = args.kv_blocks or per_request * max(concurrency) + 1
    plan = Plan(args.device, args.shape, concurrency, args.prompt_tokens, steps, kv_blocks,
                tuple(args.modes.split(",")), args.threads or None, args.routers,
                args.client_procs)  # fmt: skip
    work = args.work or Path(tempfile.mkdtemp(prefix="kvrail-bench-serving-"))
    started = time.time()
    result = run(plan, work)
    result["command"] = "python -P bench/serving/run.py " + " ".join(sys.argv[1:])
    result["machine"] = {
        "cpus": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "wall_s": time.time() - started,
    }  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
