"""Interference experiment: one user decoding, a long prompt arrives (DESIGN.md "Why", issue 4).

Run from the repository root:

    .venv/bin/python -P bench/interference/run.py --out bench/interference/

For each mode, real etcd and NATS (kvrail.local.servers) and real SmolLM2-135M workers start as
subprocesses, pinned with `taskset -c` (decode or colocated worker on core 0, prefill worker on
core 1), one torch thread each, a fresh pool per mode:

- `colocated`: one `--role colocated` worker, max_num_batched_tokens >= the long prompt (one step);
- `chunked-512`, `chunked-128`: the same with a per-step budget of 512 / 128 tokens;
- `disaggregated`: a prefill worker on core 1 and a decode worker on core 0, remote prefill above
  a low threshold.

User A sends a short prompt (greedy, ignore_eos, `--a-tokens` tokens) and the script records the
arrival time of every TokenEvent (and how many tokens it carried). Once A has `--b-after` tokens,
user B sends a long prompt (`--long-tokens`) with max_tokens 1 to the same decode worker. Output:
results.json (raw timestamps), results.md (table) and itl.png (A's inter-token gaps over time).

Gaps are per event; an event carrying k > 1 tokens counts as k gaps of (event gap / k). The client
(this script), etcd and NATS are not pinned: they share the two cores with the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient

from kvrail.bus import connect
from kvrail.codec import decode
from kvrail.keys import PoolKeys
from kvrail.local.procs import ManagedProcess
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import GenerateRequest
from kvrail.outputs import TokenEvent, TokenEventBatch
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings

READY_TIMEOUT_S = 240.0
MODES = ("colocated", "chunked-512", "chunked-128", "disaggregated")
DECODE_CORE = "0"
PREFILL_CORE = "1"
BLOCK_SIZE = 16


def prompt(num_tokens: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(100, 40_000) for _ in range(num_tokens))


@dataclass
class Stream:
    """One request's events as the client saw them (time.monotonic() at receipt)."""

    request_id: str
    sent_at: float
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    first: TokenEvent | None = None
    last: TokenEvent | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)


async def run_request(
    nc: NatsClient,
    keys: PoolKeys,
    worker_id: str,
    token_ids: tuple[int, ...],
    max_tokens: int,
    stream: Stream,
    deadline_s: float = 300.0,
) -> Stream:
    """Send one GenerateRequest (greedy, ignore_eos) and record every TokenEvent until the last."""
    subject = f"bench.stream.{stream.request_id}"
    sub = await nc.subscribe(subject)
    request = GenerateRequest(
        request_id=stream.request_id, token_ids=token_ids, stream_subject=subject,
        deadline_unix_s=time.time() + deadline_s,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )  # fmt: skip
    try:
        stream.sent_at = time.monotonic()
        await nc.publish(keys.decode_requests(worker_id), request.encode())
        stop_at = time.monotonic() + deadline_s + 5
        while stream.last is None:
            msg = await sub.next_msg(timeout=max(stop_at - time.monotonic(), 0.01))
            now = time.monotonic()
            for event in decode(msg.data, TokenEventBatch).events:
                if event.request_id != stream.request_id:
                    continue
                if event.output.error is not None:
                    raise RuntimeError(f"request {stream.request_id} failed: {event.output.error}")
                if event.output.token_ids:
                    stream.times.append(now)
                    stream.counts.append(len(event.output.token_ids))
                if stream.first is None:
                    stream.first = event
                if event.is_last:
                    stream.last = event
            stream.progress.set()
    finally:
        await sub.unsubscribe()
    return stream


class ModeRun:
    """The workers of one mode: a fresh pool, pinned subprocesses."""

    def __init__(self, mode: str, etcd: EtcdServer, nats: NatsServer, log_dir: Path, args: Any):
        self.mode = mode
        self.pool = f"intf-{mode.replace('-', '')}-{uuid.uuid4().hex[:6]}"
        self.keys = PoolKeys("default", self.pool)
        self.settings = Settings(pool=self.pool, etcd_endpoints=(etcd.endpoint,), nats_url=nats.url)
        self.log_dir = log_dir
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "KVRAIL_POOL": self.pool,
            "KVRAIL_ETCD_ENDPOINTS": etcd.endpoint,
            "KVRAIL_NATS_URL": nats.url,
            "KVRAIL_TORCH_NUM_THREADS": "1",
            "KVRAIL_NUM_KV_BLOCKS": str(args.num_kv_blocks),
            "KVRAIL_MAX_MODEL_LEN": str(args.max_model_len),
            "KVRAIL_BLOCK_SIZE": str(BLOCK_SIZE),
            "KVRAIL_LOG_LEVEL": "INFO",  # readiness is the INFO "worker ready" line
        }
        self.procs: dict[str, ManagedProcess] = {}
        big_budget = str(max(args.long_tokens + 64, 8192))
        if mode == "disaggregated":
            common = {
                "KVRAIL_DISAGGREGATION_MODE": "disaggregated",
                "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": str(args.min_remote_prefill_tokens),
                "KVRAIL_MAX_NUM_BATCHED_TOKENS": big_budget,
            }
            self.workers = [
                ("prefill-0", "prefill", PREFILL_CORE, common),
                ("decode-0", "decode", DECODE_CORE, common),
            ]
        else:
            budget = {"colocated": big_budget, "chunked-512": "512", "chunked-128": "128"}[mode]
            env = {
                "KVRAIL_DISAGGREGATION_MODE": "colocated",
                "KVRAIL_MAX_NUM_BATCHED_TOKENS": budget,
            }
            self.workers = [("colo-0", "colocated", DECODE_CORE, env)]
        self.decode_worker = self.workers[-1][0]

    def start(self) -> None:
        for worker_id, role, core, env in self.workers:
            argv = ["taskset", "-c", core, sys.executable, "-P", "-m", "kvrail.worker"]
            proc = ManagedProcess(
                f"{self.mode}-{worker_id}",
                [*argv, "--role", role, "--worker-id", worker_id],
                self.log_dir / f"{self.mode}.{worker_id}.log",
                env={**self.env, **env},
            )
            self.procs[worker_id] = proc.start()
        for proc in self.procs.values():
            proc.wait_ready(
                lambda p=proc: "worker ready" in p.log_path.read_text(), READY_TIMEOUT_S, 0.5
            )

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop(grace_s=20)


def gaps_of(stream: Stream, origin: float) -> list[dict[str, float]]:
    """Per-token gaps: (end time relative to origin, gap seconds, tokens in the event)."""
    out = []
    prev = stream.times[0] if stream.times else origin
    for t, k in zip(stream.times[1:], stream.counts[1:], strict=True):
        for _ in range(k):
            out.append({"t": t - origin, "start": prev - origin, "gap": (t - prev) / k, "k": k})
        prev = t
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    gaps = result["a_gaps"]
    b_send = result["b_sent_at_s"]
    b_first = result["b_first_token_at_s"]
    before = [g["gap"] for g in gaps if g["t"] <= b_send]
    during = [g["gap"] for g in gaps if g["t"] > b_send and g["start"] < b_first + 1e-3]
    after_b = [g["gap"] for g in gaps if g["t"] > b_send]
    median_before = statistics.median(before) if before else float("nan")
    all_gaps = [g["gap"] for g in gaps]
    return {
        "median_itl_before_b_ms": 1e3 * median_before,
        "max_itl_during_b_prefill_ms": 1e3 * max(during, default=float("nan")),
        "p99_itl_ms": 1e3 * percentile(all_gaps, 99),
        "max_itl_ms": 1e3 * max(all_gaps, default=float("nan")),
        "gaps_over_3x_median": sum(1 for g in all_gaps if g > 3 * median_before),
        "stall_sum_after_b_ms": 1e3
        * sum(g - median_before for g in after_b if g > 3 * median_before),
        "b_ttft_s": b_first - b_send,
        "a_tokens": len(all_gaps) + 1,
    }


async def measure(run: ModeRun, args: Any) -> dict[str, Any]:
    nc = await connect(run.settings, f"bench-{run.mode}")
    try:
        # Warm-up: one short and one medium request (the medium one goes remote when
        # disaggregated, so the prefill worker, the queue and the NIXL path are warm too).
        for n, seed in ((12, 901), (args.min_remote_prefill_tokens + 96, 902)):
            warm = Stream(f"warm-{uuid.uuid4().hex[:8]}", 0.0)
            await run_request(nc, run.keys, run.decode_worker, prompt(n, seed), 4, warm)
        a = Stream(f"a-{uuid.uuid4().hex[:8]}", 0.0)
        b = Stream(f"b-{uuid.uuid4().hex[:8]}", 0.0)
        a_task = asyncio.create_task(
            run_request(
                nc, run.keys, run.decode_worker, prompt(args.short_tokens, 1), args.a_tokens, a
            )
        )
        while a.num_tokens < args.b_after:
            if a_task.done():
                a_task.result()
                raise RuntimeError("A finished before B was sent")
            a.progress.clear()
            await asyncio.wait_for(a.progress.wait(), 60)
        b_task = asyncio.create_task(
            run_request(nc, run.keys, run.decode_worker, prompt(args.long_tokens, 2), 1, b)
        )
        await asyncio.gather(a_task, b_task)
    finally:
        await nc.close()
    origin = a.sent_at
    assert b.first is not None and a.first is not None
    result = {
        "mode": run.mode,
        "a_sent_at_s": 0.0,
        "a_event_times_s": [t - origin for t in a.times],
        "a_event_token_counts": a.counts,
        "a_prefill_mode": a.first.prefill_mode,
        "a_gaps": gaps_of(a, origin),
        "b_sent_at_s": b.sent_at - origin,
        "b_first_token_at_s": b.times[0] - origin,
        "b_prefill_mode": b.first.prefill_mode,
        "b_stages_s": {
            name.removesuffix("_s"): getattr(b.first.stages, name)
            for name in (
                "queue_wait_s",
                "prefill_compute_s",
                "transfer_queue_s",
                "copy_s",
                "validation_s",
                "admission_s",
            )
        }
        if b.first.stages is not None
        else {},
    }
    result["summary"] = summarize(result)
    return result


def table(results: dict[str, dict[str, Any]], args: Any) -> str:
    head = (
        "| mode | B prefill | median ITL before B (ms) | max ITL while B prefills (ms) "
        "| p99 ITL (ms) | gaps > 3x median | B TTFT (s) |\n|---|---|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for mode, r in results.items():
        s = r["summary"]
        rows.append(
            f"| {mode} | {r['b_prefill_mode']} | {s['median_itl_before_b_ms']:.1f} "
            f"| {s['max_itl_during_b_prefill_ms']:.1f} | {s['p99_itl_ms']:.1f} "
            f"| {s['gaps_over_3x_median']} | {s['b_ttft_s']:.2f} |"
        )
    note = (
        f"\nA: {args.short_tokens}-token prompt, {args.a_tokens} tokens (greedy, ignore_eos); "
        f"B: {args.long_tokens}-token prompt, max_tokens 1, "
        f"sent after A's {args.b_after}th token.\n"
    )
    return head + "\n".join(rows) + "\n" + note


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.6 * len(results)), sharex=True)
    axes = list(axes) if len(results) > 1 else [axes]
    ymax = max(max(g["gap"] for g in r["a_gaps"]) for r in results.values()) * 1e3 * 1.5
    for ax, (mode, r) in zip(axes, results.items(), strict=True):
        starts = [g["start"] for g in r["a_gaps"]]
        ends = [g["t"] for g in r["a_gaps"]]
        gs = [g["gap"] * 1e3 for g in r["a_gaps"]]
        # Each gap is drawn as a segment spanning the time it covers, at its height.
        ax.hlines(gs, starts, ends, linewidth=1.5, label="A inter-token gap (spans its interval)")
        ax.plot(ends, gs, ".", markersize=3, color="C0")
        ax.axvline(r["b_sent_at_s"], color="red", linestyle="--", linewidth=1, label="B sent")
        ax.axvline(r["b_first_token_at_s"], color="green", linestyle=":", linewidth=1.2,
                   label="B first token")  # fmt: skip
        s = r["summary"]
        ax.set_title(
            f"{mode}: median {s['median_itl_before_b_ms']:.0f} ms, max while B prefills "
            f"{s['max_itl_during_b_prefill_ms']:.0f} ms, B TTFT {s['b_ttft_s']:.2f} s",
            fontsize=10,
        )
        ax.set_ylabel("ITL (ms, log)")
        ax.set_yscale("log")
        ax.set_ylim(50, ymax)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("time since A was sent (s)")
    fig.suptitle("Decoding user A's inter-token latency when a long prompt (B) arrives")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/interference"))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--a-tokens", type=int, default=250)
    parser.add_argument("--b-after", type=int, default=40)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--min-remote-prefill-tokens", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=400)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--replot", action="store_true", help="only redo results.md and itl.png from results.json"
    )
    args = parser.parse_args()
    if args.replot:
        saved = json.loads((args.out / "results.json").read_text())
        for key, value in saved["meta"]["args"].items():
            if key not in ("out", "replot"):
                setattr(args, key, value)
        md = table(saved["modes"], args)
        (args.out / "results.md").write_text(md)
        print(md)
        plot(saved["modes"], args.out / "itl.png")
        return 0
    if shutil.which("taskset") is None:
        print("taskset not found (util-linux)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvrail-interference-"))
    etcd = EtcdServer(root / "etcd", root / "etcd.log")
    nats = NatsServer(root / "js", root / "nats.log")
    results: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    try:
        etcd.start()
        nats.start()
        for mode in args.modes.split(","):
            run = ModeRun(mode, etcd, nats, root / "logs", args)
            try:
                t_mode = time.monotonic()
                run.start()
                results[mode] = asyncio.run(measure(run, args))
                s = results[mode]["summary"]
                print(
                    f"{mode}: done in {time.monotonic() - t_mode:.0f}s; "
                    f"median ITL {s['median_itl_before_b_ms']:.1f} ms, "
                    f"max during B {s['max_itl_during_b_prefill_ms']:.1f} ms, "
                    f"B TTFT {s['b_ttft_s']:.2f} s",
                    flush=True,
                )
            except Exception:
                for proc in run.procs.values():
                    print(f"--- {proc.name} log tail ---\n{proc.tail()}", file=sys.stderr)
                raise
            finally:
                run.stop()
    finally:
        nats.stop()
        etcd.stop()
        if results:
            meta = {
                "args": {k: str(v) for k, v in vars(args).items()},
                "wall_s": time.monotonic() - t0,
            }
            (args.out / "results.json").write_text(
                json.dumps({"meta": meta, "modes": results}, indent=1) + "\n"
            )
            md = table(results, args)
            (args.out / "results.md").write_text(md)
            print(md)
            plot(results, args.out / "itl.png")
        if args.keep_logs:
            print(f"logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
