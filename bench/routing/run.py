"""KV-aware vs least-loaded vs round-robin routing on a shared-prefix workload (CPU, SmolLM2).

Run from the repository root (about 8 minutes on the 2-core development VM):

    .venv/bin/python -P bench/routing/run.py --out bench/routing/

What runs: real etcd and NATS (`kvrail.local.servers`), then for each rate and each policy a fresh
pool (`kvrail.testing.pool.LocalPool`, a new pool name): two SmolLM2-135M workers (`--role
colocated`, colocated, one torch thread each) and one router with `KVRAIL_ROUTER_POLICY=<policy>`.
The workers are new processes for every (rate, policy), so each starts from empty prefix caches and
no policy benefits from a cache another one warmed. The load generator (`bench/loadgen/`,
imported) then sends a Poisson stream of chat requests: one of `--prefixes` system prompts of
`--prefix-tokens` words (one word is one SmolLM2 token) followed by a short unique question, and
`--output-tokens` tokens out. Every policy gets the same requests at the same times (same seed; each
rate has its own seed). The policies run one after the other within a rate, in reverse order at
every other rate, so a change in the machine's load is not all on one policy.

NIXL's progress thread is off in the workers (`--nixl-progress-thread off`, the default): its UCX
backend busy-polls, so an idle worker keeps a core busy in it (`bench/studies/routing/idle_cpu.py`),
which on two cores is CPU the model does not get; colocated workers never transfer KV, so nothing
else changes. `no_nixl_progress_thread/sitecustomize.py`, on the PYTHONPATH of the pool's processes
(the router creates no NIXL agent), does it without any change to kvrail; `--nixl-progress-thread
on` measures the workers as they ship.

The KV cache per worker (`--num-kv-blocks`, 16-token blocks) is sized so that one worker cannot
hold every system prompt but the two together can. With a cache large enough for all of them,
every policy ends with every prefix cached on both workers after a few misses, and the policies
only differ in those first misses; with the whole prefix set larger than one worker's cache,
where requests go decides how often a prefix must be computed again.

Measured per policy and rate: the load generator's report (TTFT, ITL, TPOT, throughput, goodput
under `--slo-ttft-s` / `--slo-itl-s`; every request with the server's response id), and from the
servers:
- the router's `/metrics`: `kvrail_routing_decisions_total{cache}` (hit: the chosen worker held
  at least one leading block of the prompt, warm-up requests included) and the mean of
  `kvrail_ttft_stage_seconds{stage="prefill_compute"}` (submit to first token on the worker);
- the workers' KV events on NATS: blocks stored per worker (blocks computed and cached) and the
  blocks both workers stored (computed twice);
- which worker served each request, and its submit-to-first-token time there (the workers'
  "first token" log lines, joined on the response id).
Before each point the script waits (up to `--max-wait-s`) until other people's jobs use at most
`--max-external-cores` CPU; during the run it samples every 5 s the load average and the CPU
used outside its own process tree. Output: `results.json` and `ttft.png` in `--out`, and the
tables of `report.py` (which re-renders them from results.json) on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path
from types import FrameType
from typing import Any

from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from kvrail.bus import connect
from kvrail.codec import decode
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import KvEvent
from kvrail.testing.pool import LocalPool
from kvrail.testing.scripts import load_script

POLICIES = ("round-robin", "least-loaded", "kv-aware")
MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16


HERE = Path(__file__).resolve().parent
lg = load_script("kvrail_bench_loadgen", HERE.parent / "loadgen" / "__init__.py")
reporting = load_script("kvrail_bench_routing_report", HERE / "report.py")


# -- what the servers say --------------------------------------------------------------------------


_STAGE = "kvrail_ttft_stage_seconds_"
_STAGE_SAMPLES = (_STAGE + "sum", _STAGE + "count")


def scrape(url: str) -> dict[str, float]:
    """The router's counters this experiment reads, from its Prometheus text."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvrail_routing_decisions_total":
                out[f"decisions_{s.labels['cache']}"] += s.value
            elif s.name in _STAGE_SAMPLES and s.labels.get("stage") == "prefill_compute":
                out["prefill_compute_" + s.name.removeprefix(_STAGE)] += s.value
    return dict(out)


class KvEvents:
    """Every worker's KV events: which block hashes each one stored and removed."""

    def __init__(self) -> None:
        self.stored: dict[str, set[str]] = defaultdict(set)
        self.num_stored: dict[str, int] = defaultdict(int)
        self.num_removed: dict[str, int] = defaultdict(int)

    async def on_msg(self, msg: Msg) -> None:
        event = decode(msg.data, KvEvent)
        if event.cleared:  # a full-state reply, not a change
            return
        self.stored[event.worker_id].update(event.stored)
        self.num_stored[event.worker_id] += len(event.stored)
        self.num_removed[event.worker_id] += len(event.removed)

    def snapshot(self) -> dict[str, Any]:
        sets = list(self.stored.values())
        both = set.intersection(*sets) if len(sets) == 2 else set()
        return {
            "blocks_stored": dict(self.num_stored),
            "blocks_removed": dict(self.num_removed),
            "distinct_blocks_stored_by_both": len(both),
        }


_FIRST_TOKEN = re.compile(r"first token request_id=(\S+) .*prefill_compute_s=([0-9.]+)")


def first_tokens(log_path: Path) -> dict[str, float]:
    """Request id -> submit-to-first-token seconds, from a worker's "first token" log lines."""
    found = (_FIRST_TOKEN.search(line) for line in log_path.read_text().splitlines())
    return {m[1]: float(m[2]) for m in found if m}


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = delta(value, before.get(key, {}))
        else:
            out[key] = value - before.get(key, 0)
    return out


def server_stats(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the servers counted during one load point (after minus before)."""
    d = delta(after, before)
    # A set's size, not a counter: the state after the point.
    both = "distinct_blocks_stored_by_both"
    d["kv"][both] = after["kv"][both]
    hits, misses = d["router"].get("decisions_hit", 0), d["router"].get("decisions_miss", 0)
    n = d["router"].get("prefill_compute_count", 0)
    d["cache_hit_rate"] = hits / (hits + misses) if hits + misses else None
    d["prefill_compute_mean_s"] = d["router"].get("prefill_compute_sum", 0) / n if n else None
    return d


# -- one policy at one rate ------------------------------------------------------------------------


async def run_point(
    policy: str, k: int, etcd: EtcdServer, nats: NatsServer, log_dir: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """A fresh pool (two workers, a router with `policy`), rate number `k`, then stop the pool."""
    env = {
        "KVRAIL_DISAGGREGATION_MODE": "colocated",
        "KVRAIL_TORCH_NUM_THREADS": "1",
        "KVRAIL_NUM_KV_BLOCKS": str(args.num_kv_blocks),
        "KVRAIL_MAX_MODEL_LEN": str(args.max_model_len),
        "KVRAIL_BLOCK_SIZE": str(BLOCK_SIZE),
        "KVRAIL_REQUEST_TIMEOUT_S": "300",
        "KVRAIL_LOG_LEVEL": "INFO",
    }
    if args.nixl_progress_thread == "off":
        shim = str(HERE / "no_nixl_progress_thread")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))
    name = f"routing-{policy.replace('-', '')}-{k}-{uuid.uuid4().hex[:6]}"
    pool = LocalPool(etcd, nats, log_dir / f"{policy}-{k}", name, env)
    events = KvEvents()
    nc = await connect(pool.settings, f"bench-routing-{policy}")
    await nc.subscribe(pool.keys.kv_events_all, cb=events.on_msg)
    port = free_port()
    workers = ("decode-0", "decode-1")
    started = time.monotonic()
    try:
        for worker_id in workers:
            pool.start(worker_id, "colocated")
        for worker_id in workers:
            await asyncio.to_thread(pool.wait_ready, worker_id)
        pool.start_router("router", KVRAIL_HTTP_PORT=str(port), KVRAIL_ROUTER_POLICY=policy)
        await asyncio.to_thread(pool.wait_ready, "router")
        ready_s = time.monotonic() - started
        print(f"{policy}: pool ready in {ready_s:.0f}s", file=sys.stderr, flush=True)

        def state() -> dict[str, Any]:
            served = {w: len(first_tokens(pool.procs[w].log_path)) for w in workers}
            return {"router": scrape(f"http://127.0.0.1:{port}/metrics"),
                    "kv": events.snapshot(), "served": served}  # fmt: skip

        target = lg.Target(f"http://127.0.0.1:{port}/v1", MODEL, temperature=0.0)
        slo = lg.Slo(ttft_s=args.slo_ttft_s, itl_s=args.slo_itl_s, itl_stat="p99")
        workload = lg.Workload(
            prompt_tokens=args.user_tokens, output_tokens=args.output_tokens,
            num_prefixes=args.prefixes, prefix_tokens=args.prefix_tokens, seed=args.seed + k,
        )  # fmt: skip
        point = lg.LoadPoint("poisson", rate=args.rates[k], num_requests=args.num_requests,
                             num_warmup=args.warmup)  # fmt: skip
        before = state()
        [report] = await lg.run(target, workload, [point], slo)
        await asyncio.sleep(1.0)  # the last KV events
        report["servers"] = server_stats(before, state())
        for worker_id in workers:
            for request_id, seconds in first_tokens(pool.procs[worker_id].log_path).items():
                for r in report["requests"]:
                    if r["response_id"] == request_id:
                        r["worker"], r["worker_prefill_s"] = worker_id, seconds
        report["policy"] = policy
        report["pool"] = name
        report["pool_ready_s"] = ready_s
        print(lg.table([report]), file=sys.stderr, flush=True)
        return dict(report)
    finally:
        await nc.close()
        await asyncio.to_thread(pool.stop)


# -- the whole run ---------------------------------------------------------------------------------


def busy_jiffies() -> int:
    """CPU time spent busy on all cores since boot (/proc/stat), in clock ticks."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return user + nice + system + irq + softirq + steal


def tree_jiffies(root: int) -> dict[int, int]:
    """CPU ticks (user + system, all threads) of `root` and of every process below it."""
    parents, ticks = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            parents[int(entry.name)] = int(fields[1])
            ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    ours, grew = {root}, True
    while grew:
        below = {pid for pid, ppid in parents.items() if ppid in ours} - ours
        ours |= below
        grew = bool(below)
    return {pid: ticks[pid] for pid in ours if pid in ticks}


class CpuMeter:
    """Cores busy between two samples: in all, and outside this process tree (other people's
    jobs on a shared machine). A process of ours that exited between samples counts as
    external for its last moments, so `external` is an upper bound."""

    def __init__(self) -> None:
        self.last = self._read()

    @staticmethod
    def _read() -> tuple[float, int, dict[int, int]]:
        return time.monotonic(), busy_jiffies(), tree_jiffies(os.getpid())

    def sample(self) -> tuple[float, float]:
        t0, busy0, ours0 = self.last
        self.last = t1, busy1, ours1 = self._read()
        ticks = max(t1 - t0, 1e-3) * os.sysconf("SC_CLK_TCK")
        ours = sum(v - ours0.get(pid, 0) for pid, v in ours1.items())
        busy = (busy1 - busy0) / ticks
        return busy, max(busy - ours / ticks, 0.0)


async def sample_load(samples: list[dict[str, Any]], phase: list[str]) -> None:
    start = time.monotonic()
    meter = CpuMeter()
    while True:
        await asyncio.sleep(5)
        busy, external = meter.sample()
        one, five, fifteen = os.getloadavg()
        samples.append({
            "t_s": round(time.monotonic() - start, 1), "phase": phase[0], "load1": one,
            "load5": five, "load15": fifteen, "busy_cores": round(busy, 2),
            "external_cores": round(external, 2),
        })  # fmt: skip


async def wait_for_quiet(max_external_cores: float, max_wait_s: float) -> dict[str, float]:
    """Wait (up to `max_wait_s`) until other people's jobs use at most `max_external_cores`."""
    meter = CpuMeter()
    started = time.monotonic()
    while True:
        await asyncio.sleep(3)
        _, external = meter.sample()
        waited = time.monotonic() - started
        if external <= max_external_cores or waited >= max_wait_s:
            return {"external_cores": round(external, 2), "waited_s": round(waited, 1)}
        print(f"waiting for a quieter machine: other jobs use {external:.1f} cores",
              file=sys.stderr, flush=True)  # fmt: skip


def phase_load(samples: list[dict[str, Any]], phase: str) -> dict[str, float | None]:
    """Median load average and external cores over a phase's samples."""
    mine = [s for s in samples if s["phase"] == phase]
    return {
        "load1_median": lg.percentile([s["load1"] for s in mine], 50),
        "external_cores_median": lg.percentile([s["external_cores"] for s in mine], 50),
        "external_cores_max": max((s["external_cores"] for s in mine), default=None),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvrail-bench-routing-"))
    print(f"logs in {root}", file=sys.stderr, flush=True)
    etcd = EtcdServer(root / "etcd", root / "etcd.log").start()
    nats = NatsServer(root / "js", root / "nats.log").start()
    samples: list[dict[str, Any]] = []
    phase = ["start"]
    sampler = asyncio.create_task(sample_load(samples, phase))
    started = time.time()
    runs: list[dict[str, Any]] = [{"policy": p, "points": []} for p in args.policies]
    try:
        for k in range(len(args.rates)):
            # Interleaved, and reversed every other rate, so a drift in the machine's load
            # does not fall on one policy.
            order = list(enumerate(args.policies))
            for i, policy in order if k % 2 == 0 else order[::-1]:
                phase[0] = "waiting"
                quiet = await wait_for_quiet(args.max_external_cores, args.max_wait_s)
                phase[0] = f"{policy}@{args.rates[k]:g}"
                point = await run_point(policy, k, etcd, nats, root, args)
                point["before_start"] = quiet
                runs[i]["points"].append(point)
    finally:
        sampler.cancel()
        nats.stop()
        etcd.stop()
    for run in runs:
        for point in run["points"]:
            phase_name = f"{run['policy']}@{point['point']['rate']:g}"
            point["machine_load"] = phase_load(samples, phase_name)
    config = {k: str(v) if isinstance(v, lg.Lengths | Path) else v for k, v in vars(args).items()}
    return {
        "command": "python -P bench/routing/run.py " + " ".join(sys.argv[1:]),
        "started_unix_s": started,
        "wall_s": time.time() - started,
        "config": config,
        "machine": lg.machine(),
        "loadavg_samples": samples,
        "runs": runs,
    }


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=Path("bench/routing"))
    p.add_argument("--policies", type=lambda t: t.split(","), default=list(POLICIES))
    p.add_argument("--rates", type=_floats, default=[0.5, 0.8], help="Poisson requests/s")
    p.add_argument("--num-requests", type=int, default=32, help="measured, per rate")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=400)
    p.add_argument("--user-tokens", type=lg.Lengths.parse, default=lg.Lengths(8, 24))
    p.add_argument("--output-tokens", type=lg.Lengths.parse, default=lg.Lengths(16, 16))
    p.add_argument("--num-kv-blocks", type=int, default=80, help="per worker, incl. null block")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-itl-s", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-external-cores",
        type=float,
        default=0.3,
        help="before each point, wait until other jobs use at most this much CPU",
    )
    p.add_argument("--max-wait-s", type=float, default=180.0, help="... but no longer")  # fmt: skip
    p.add_argument(
        "--nixl-progress-thread", choices=("on", "off"), default="off",
        help="off: workers load no_nixl_progress_thread/sitecustomize.py (see its docstring)",
    )  # fmt: skip
    return p.parse_args()


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so every `finally` stops its processes


def main() -> int:
    args = parse_args()
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    signal.signal(signal.SIGTERM, _stop)
    result = asyncio.run(main_async(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    reporting.plot(result["runs"], args.out / "ttft.png")
    print(reporting.tables(result["runs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
