"""Can the load generator keep up? Its own cost per streamed chunk, and what it does to the ITL.

    .venv/bin/python -P bench/studies/client/loadgen_cost.py --rate 20 --requests 150 \\
        --processes 1,2 --rounds 2

A stand-in server (this script with `--standin`, in its own process) answers every chat
completion with `--tokens` chunks, one every `--gap-ms`, exactly, as an OpenAI-compatible
server would stream them. So every gap the client sees above `--gap-ms` is the client's own
delay (or the shared cores'). Each round runs the same Poisson schedule through
`loadgen.run_point` with each number of client processes in turn, and prints the gaps' p50/p99
and the CPU of the client processes (this one and those it starts, their start included; not
the stand-in's).

Why it exists: on the H200 sweeps the ITL p50 at 32 req/s was 0.1-0.2 ms, with p99s of 300-540 ms.
No engine steps in 0.2 ms. That pattern is a client reading its sockets late, then taking a
backlog of chunks at once. On the 2-vCPU development VM one process of `openai.AsyncOpenAI`
costs about 0.3 ms of CPU per chunk (`loadgen_cost.txt`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvrail.local.procs import ManagedProcess, free_port, port_in_use
from kvrail.testing.scripts import load_script

lg = load_script(
    "kvrail_bench_loadgen", Path(__file__).resolve().parents[2] / "loadgen" / "__init__.py"
)


def _sse(payload: dict[str, Any]) -> bytes:
    data = b"data: " + json.dumps(payload).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _chunk(port: int, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": f"chatcmpl-standin-{port}", "object": "chat.completion.chunk", "created": 0,
            "model": "standin", "choices": choices, **extra}  # fmt: skip


async def serve_standin(port: int, num_tokens: int, gap_s: float) -> None:
    """Answer every request on `port` with `num_tokens` text chunks `gap_s` apart, then a finish
    chunk, a usage chunk and `[DONE]` (HTTP/1.1, chunked, keep-alive). The response id names
    the port, so a client can tell which stand-in answered."""
    text = [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}
            for i in range(num_tokens)]  # fmt: skip
    tokens = [_sse(_chunk(port, [choice])) for choice in text]
    usage = {"prompt_tokens": 1, "completion_tokens": num_tokens, "total_tokens": num_tokens + 1}
    done = b"15\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"  # the last SSE event, then the last chunk
    tail = (_sse(_chunk(port, [{"index": 0, "delta": {}, "finish_reason": "length"}]))
            + _sse(_chunk(port, [], usage=usage)) + done)  # fmt: skip
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in request.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                await reader.readexactly(length)
                writer.write(head)
                for token in tokens:
                    await asyncio.sleep(gap_s)
                    writer.write(token)
                writer.write(tail)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def _cpu_s() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(port: int, rate: float, num_requests: int, processes: int) -> dict[str, Any]:
    target = lg.Target(f"http://127.0.0.1:{port}/v1", "standin", timeout_s=600.0)
    workload = lg.Workload(lg.Lengths(16, 16), lg.Lengths(1, 1), seed=1)
    point = lg.LoadPoint("poisson", rate=rate, num_requests=num_requests)
    cpu0, t0 = _cpu_s(), time.perf_counter()
    results = asyncio.run(lg.run_point(target, workload, point, show_progress=False,
                                       processes=processes))  # fmt: skip
    wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    gaps = [g for r in results for g in r.gaps_s]
    return {
        "processes": processes, "requests": len(results),
        "errors": sum(r.error is not None for r in results),
        "chunks": sum(len(r.chunk_times_s) for r in results), "wall_s": wall, "cpu_s": cpu,
        "gap_p50_ms": 1000 * (lg.percentile(gaps, 50) or 0),
        "gap_p99_ms": 1000 * (lg.percentile(gaps, 99) or 0),
    }  # fmt: skip


def start_standin(port: int, num_tokens: int, gap_ms: float, log_path: Path) -> ManagedProcess:
    """`serve_standin` in a process of its own (it dies with its parent), once it listens."""
    argv = [sys.executable, "-P", __file__, "--standin", str(port), "--tokens", str(num_tokens),
            "--gap-ms", str(gap_ms)]  # fmt: skip
    standin = ManagedProcess("standin", argv, log_path).start()
    standin.wait_ready(lambda: port_in_use("127.0.0.1", port), 30.0, 0.05)
    return standin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--standin", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--gap-ms", type=float, default=20.0)
    p.add_argument("--processes", type=lambda t: [int(v) for v in t.split(",")], default=[1, 2])
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    if args.standin is not None:
        asyncio.run(serve_standin(args.standin, args.tokens, args.gap_ms / 1000))
        return
    port = free_port()
    standin = start_standin(
        port, args.tokens, args.gap_ms, Path(tempfile.mkdtemp()) / "standin.log"
    )
    try:
        print(f"stand-in: {args.tokens} chunks {args.gap_ms:g} ms apart; Poisson {args.rate:g}/s, "
              f"{args.requests} requests per run")  # fmt: skip
        for round_ in range(1, args.rounds + 1):
            for n in args.processes:
                m = measure(port, args.rate, args.requests, n)
                print(f"round {round_} processes={n}: {m['requests']} requests, "
                      f"{m['errors']} errors, {m['chunks']} chunks in {m['wall_s']:.1f} s; "
                      f"CPU {m['cpu_s']:.1f} s; gap p50 {m['gap_p50_ms']:.1f} ms, "
                      f"p99 {m['gap_p99_ms']:.1f} ms", flush=True)  # fmt: skip
    finally:
        standin.stop()


if __name__ == "__main__":
    main()
