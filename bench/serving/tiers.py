"""KV tiers under a multi-turn workload: kvrail without tiers, with the host tier, and vLLM's CPU
offloading, on the same GPU KV budget, the same client and the same sessions.

    .venv/bin/python -P bench/serving/tiers.py --cpu-smoke --out /tmp/tiers-cpu.json  # minutes
    bash bench/serving/tiers-gpu.sh kvrail        # the lent GPU, one setup a call (the script)

Setups (`--setups`), each started fresh on real etcd and NATS, one after the other:
- `kvrail`: a colocated worker (`LocalPool`, `python -P -m kvrail.worker`) with
  `--kv-blocks` GPU KV blocks and no lower tier, and the router;
- `kvrail-host`: the same with `KVRAIL_KV_HOST_TIER_BYTES` = `--host-tier-gib`;
- `vllm`: vLLM's OpenAI server on the same model directory (`--shape`'s random model, so only
  with `--shape`) with `--num-gpu-blocks-override` = `--kv-blocks` (the same GPU KV budget: both
  use 16-token blocks), `--kv-offloading-backend native --kv-offloading-size` = `--host-tier-gib`
  and `--enable-prompt-tokens-details` (so it reports cached tokens, as kvrail's router always
  does); `--vllm-pythonpath` is where vLLM is installed.

The workload is `multiturn.py`'s (its docstring has the definitions): `--sessions` sessions of
`--turns` turns, at each of `--session-rates` (sessions/s) or `--concurrency` (session slots),
every point with its own seed (no point reuses another's prefixes), after a small warm-up load
(Triton compiles). Every answer is `--output-tokens` long (`ignore_eos`). Before the run the
planned live-prefix ratio is printed (the sessions' final prompts, in words, against the pool's
`(kv_blocks - 1) * 16` tokens); each point reports the measured one. After each kvrail point the
worker's `kvrail_kv*` metrics (the tiers' hits, loads, offloads and bytes) are scraped into it.

`--shape` writes (once) a random-weight model with the synthetic word-level tokenizer
(`bench/sweep/model.py`: Llama-3-8B on the GPU), where every generated token is one chunk and an
answer re-encodes to the same tokens, so a turn's prompt can reuse all of the previous one's KV.
Without it the workers load `--model` (default: SmolLM2, `kvrail.model_files`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvrail.local.procs import ManagedProcess, free_port, http_ok
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool
from kvrail.testing.scripts import load_script

HERE = Path(__file__).resolve().parent
lg = load_script("kvrail_bench_loadgen", HERE.parent / "loadgen" / "__init__.py")
mt = load_script("kvrail_bench_serving_multiturn", HERE / "multiturn.py")
sweep = load_script("kvrail_bench_sweep_run", HERE.parent / "sweep" / "run.py")
BLOCK_SIZE = 16
SETUPS = ("kvrail", "kvrail-host", "vllm")
SERVED = "bench"


def pool_tokens(kv_blocks: int) -> int:
    """Tokens the GPU KV pool holds: every block but the null one."""
    return (kv_blocks - 1) * BLOCK_SIZE


def worker_env(args: argparse.Namespace, setup: str, metrics_port: int) -> dict[str, str]:
    env = {
        "KVRAIL_NUM_KV_BLOCKS": str(args.kv_blocks),
        "KVRAIL_BLOCK_SIZE": str(BLOCK_SIZE),
        "KVRAIL_MAX_MODEL_LEN": str(args.max_model_len),
        "KVRAIL_MAX_NUM_BATCHED_TOKENS": str(args.chunk_tokens),
        "KVRAIL_DISAGGREGATION_MODE": "colocated",
        "KVRAIL_SERVED_MODEL_NAME": SERVED,
        "KVRAIL_REQUEST_TIMEOUT_S": "600",
        "KVRAIL_TORCH_NUM_THREADS": str(args.torch_threads),
        "KVRAIL_HTTP_PORT": str(metrics_port),
        "KVRAIL_KV_HOST_TIER_BYTES": str(host_tier_bytes(args) if setup == "kvrail-host" else 0),
    }
    if args.model_dir is not None:
        env["KVRAIL_MODEL"] = str(args.model_dir)
    elif args.model:
        env["KVRAIL_MODEL"] = args.model
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def host_tier_bytes(args: argparse.Namespace) -> int:
    return int(args.host_tier_gib * (1 << 30))


def vllm_argv(args: argparse.Namespace, port: int) -> list[str]:
    """vLLM's server on the random model, the same GPU KV budget, its native CPU offloading."""
    return [
        args.vllm_python, "-P", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(args.model_dir.absolute()), "--served-model-name", SERVED,
        "--max-model-len", str(args.max_model_len), "--seed", "0", "--host", "127.0.0.1",
        "--port", str(port), "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(args.kv_blocks), "--enable-prompt-tokens-details",
        "--max-num-batched-tokens", str(args.chunk_tokens),
        "--kv-offloading-backend", "native", "--kv-offloading-size", f"{args.host_tier_gib:g}",
        *shlex.split(args.vllm_args),
    ]  # fmt: skip


KV_METRIC = re.compile(r"^(kvrail_kv\w*)(\{[^}]*\})? (\S+)$")


def kv_metrics(text: str) -> dict[str, float]:
    """The `kvrail_kv*` samples of a Prometheus text page (the tiers' and the GPU pool's), without
    histogram buckets and the client's `_created` timestamps."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        m = KV_METRIC.match(raw)
        if m and not m.group(1).endswith(("_bucket", "_created")):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def scrape(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return kv_metrics(reply.read().decode())
    except OSError as err:
        return {"scrape_error": 1.0, "errno": float(getattr(err, "errno", 0) or 0)}


def plan_for(args: argparse.Namespace, seed: int) -> Any:
    return mt.MultiTurn(args.sessions, args.turns, args.first_tokens, args.user_tokens,
                        args.output_tokens, args.think_s, seed)  # fmt: skip


def loads(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    if args.concurrency:
        return [(f"concurrency {c}", {"concurrency": c}) for c in args.concurrency]
    return [(f"{r:g} sessions/s", {"rate": r}) for r in args.session_rates]


async def run_setup(
    setup: str, etcd: EtcdServer, nats: NatsServer, root: Path, args: argparse.Namespace,
    result: dict[str, Any],
) -> None:  # fmt: skip
    entry: dict[str, Any] = {"setup": setup, "points": []}
    result["setups"].append(entry)
    logs = root / setup
    logs.mkdir(parents=True, exist_ok=True)
    port, metrics_port = free_port(), free_port()
    pool: LocalPool | None = None
    server: ManagedProcess | None = None
    t0 = time.monotonic()
    try:
        if setup == "vllm":
            argv = vllm_argv(args, port)
            env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
            if args.vllm_pythonpath:
                env["PYTHONPATH"] = args.vllm_pythonpath
            entry["server"] = {"argv": argv}
            # its own folder as the working directory: this repository's `operator/` would
            # shadow the standard library's in vLLM's helper processes (bench/sweep/run.py)
            server = ManagedProcess("vllm", argv, logs / "vllm.log", env, cwd=logs).start()
            health = f"http://127.0.0.1:{port}/health"
            await asyncio.to_thread(server.wait_ready, lambda: http_ok(health),
                                    args.ready_timeout_s, 1.0)  # fmt: skip
            entry["server"].update(sweep.vllm_server_facts(server.log_text()))
        else:
            env = worker_env(args, setup, metrics_port)
            entry["worker_env"] = env
            pool = LocalPool(etcd, nats, logs, f"tiers-{setup}-{port}", env)
            pool.start("worker-0", "colocated")
            await asyncio.to_thread(pool.wait_ready, "worker-0", args.ready_timeout_s)
            pool.start_router("router-0", KVRAIL_HTTP_PORT=str(port))
            await asyncio.to_thread(pool.wait_ready, "router-0", 120)
        entry["ready_s"] = time.monotonic() - t0
        print(f"{setup}: ready in {entry['ready_s']:.0f}s", file=sys.stderr, flush=True)
        target = lg.Target(f"http://127.0.0.1:{port}/v1", SERVED, temperature=0.0,
                           timeout_s=600.0, extra_body={"ignore_eos": True})  # fmt: skip
        if args.warmup_sessions:
            warm = mt.MultiTurn(args.warmup_sessions, 2, lg.Lengths(32, 64), lg.Lengths(16, 16),
                                min(args.output_tokens, 8), 0.0, args.seed + 99_999)  # fmt: skip
            await mt.run_point(target, warm, concurrency=args.warmup_sessions)
        for i, (label, load) in enumerate(loads(args)):
            plan = plan_for(args, args.seed + 1000 * (i + 1))
            before = scrape(metrics_port) if pool is not None else {}
            p0 = time.monotonic()
            turns = await mt.run_point(target, plan, **load)
            summary = mt.summarize(turns, pool_tokens(args.kv_blocks))
            point: dict[str, Any] = {
                "load": label,
                **load,
                "seed": plan.seed,
                "seconds": time.monotonic() - p0,
                "summary": summary,
            }
            if pool is not None:
                point["metrics_before"], point["metrics_after"] = before, scrape(metrics_port)
            point["turns"] = mt.turn_records(turns)
            entry["points"].append(point)
            sweep.write_json(args.out, result)
            print(mt.line(f"{setup} {label}", summary), file=sys.stderr, flush=True)
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop, 60.0)
        if pool is not None:
            await asyncio.to_thread(pool.stop)
        entry["seconds"] = time.monotonic() - t0
        sweep.write_json(args.out, result)


def table(result: dict[str, Any]) -> str:
    """The results as a markdown table: one row per setup and load."""
    rows = ["| setup | load | TTFT p50 / p99 ms | request ITL p99, p99 ms | goodput ITL / TPOT "
            "rule | prompt tokens computed (of total) | cached, turns >= 1 | live / pool |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:,.0f}"

    for entry in result["setups"]:
        for p in entry["points"]:
            s = p["summary"]
            later = [f for t, f in s["cached_fraction_by_turn"].items() if int(t) >= 1]
            cached = f"{sum(later) / len(later):.0%}" if later else "-"
            rows.append(
                f"| {entry['setup']} | {p['load']} | {ms(s['ttft_s']['p50'])} / "
                f"{ms(s['ttft_s']['p99'])} | {ms(s['request_itl_p99_s']['p99'])} | "
                f"{s['goodput']['num_good']} / {s['goodput_tpot']['num_good']} of "
                f"{s['num_requests']} | {s['prompt_tokens_computed']} ({s['prompt_tokens_total']})"
                f" | {cached} | {s['live_prefix_ratio']:.1f} |"
            )
    return "\n".join(rows)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = args.work or Path(tempfile.mkdtemp(prefix="kvrail-bench-tiers-"))
    print(f"logs in {root}", file=sys.stderr, flush=True)
    info: dict[str, Any] = {"source": args.model or "smollm2 (kvrail.model_files)"}
    if args.shape:
        args.model_dir = args.model_dir or root / f"model-{args.shape}"
        info = sweep.randmodel.write_model_dir(args.model_dir, args.shape, lg.WORDS,
                                               device=args.device)  # fmt: skip
    planned = mt.planned_final_prompt_words(plan_for(args, args.seed))
    print(f"planned live prefixes: {planned} tokens (about) in the sessions' final prompts, "
          f"{planned / pool_tokens(args.kv_blocks):.1f}x the GPU KV pool's "
          f"{pool_tokens(args.kv_blocks)} tokens; host tier {args.host_tier_gib:g} GiB",
          file=sys.stderr, flush=True)  # fmt: skip
    config = {k: str(v) if isinstance(v, lg.Lengths | Path) else v for k, v in vars(args).items()}
    result: dict[str, Any] = {
        "command": "python -P bench/serving/tiers.py " + " ".join(sys.argv[1:]),
        "config": config, "model": info, "planned_final_prompt_tokens": planned,
        "pool_tokens": pool_tokens(args.kv_blocks), "host_tier_bytes": host_tier_bytes(args),
        "machine": {**lg.machine(), "gpu": sweep.observe.gpu_memory()},
        "versions": sweep.observe.versions(), "setups": [],
    }  # fmt: skip
    planes = any(s != "vllm" for s in args.setups)  # vLLM alone needs no etcd or NATS
    etcd = EtcdServer(root / "etcd", root / "etcd.log")
    nats = NatsServer(root / "js", root / "nats.log")
    try:
        if planes:
            etcd.start()
            nats.start()
        for setup in args.setups:
            await run_setup(setup, etcd, nats, root, args, result)
    finally:
        if planes:
            nats.stop()
            etcd.stop()
        sweep.write_json(args.out, result)
    return result


CPU_SMOKE: dict[str, Any] = {
    # SmolLM2 on the CPU: 8 sessions' final prompts about 4x the pool of 31 * 16 tokens, every
    # session live at once; about 4 minutes for both kvrail setups on 2 cores
    "device": "cpu", "kv_blocks": 32, "host_tier_gib": 0.25, "max_model_len": 480,
    "chunk_tokens": 256, "torch_threads": 1, "sessions": 8, "turns": 4, "output_tokens": 8,
    "think_s": 0.5, "first_tokens": lg.Lengths(96, 96), "user_tokens": lg.Lengths(24, 24),
    "concurrency": [8], "warmup_sessions": 1,
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="the CPU run: SmolLM2, 32 blocks, 8 sessions of 4 turns, all at once",
    )
    p.add_argument("--setups", type=lambda t: t.split(","), default=["kvrail", "kvrail-host"])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument(
        "--shape",
        choices=sorted(sweep.randmodel.SHAPES),
        help="a random-weight model of this shape (needed by the vllm setup)",
    )
    p.add_argument("--model", help="the workers' model without --shape (default: SmolLM2)")
    p.add_argument("--model-dir", type=Path, help="where --shape's model is written (once)")
    p.add_argument("--kv-blocks", type=int, default=2048, help="GPU KV blocks of 16 tokens")
    p.add_argument("--host-tier-gib", type=float, default=32.0)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--chunk-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--torch-threads", type=int, default=4)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-tokens", type=lg.Lengths.parse, default=lg.Lengths(2000, 2000))
    p.add_argument("--user-tokens", type=lg.Lengths.parse, default=lg.Lengths(300, 500))
    p.add_argument("--output-tokens", type=int, default=200)
    p.add_argument("--think-s", type=float, default=5.0, help="mean think time")
    p.add_argument("--session-rates", type=lambda t: [float(v) for v in t.split(",")],
                   default=[0.5, 1.0, 2.0])  # fmt: skip
    p.add_argument("--concurrency", type=lambda t: [int(v) for v in t.split(",")],
                   help="session slots instead of --session-rates")  # fmt: skip
    p.add_argument("--warmup-sessions", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--vllm-python", default=sys.executable)
    p.add_argument("--vllm-pythonpath", help="the vllm setup: where vLLM is installed")
    p.add_argument("--vllm-args", default="", help="more vLLM server flags (last wins)")
    p.add_argument("--work", type=Path, help="logs (and the model); default: a temp dir")
    p.add_argument("--out", type=Path, default=Path("tiers.json"))
    if p.parse_known_args(argv)[0].cpu_smoke:  # defaults only: flags given still win
        p.set_defaults(**CPU_SMOKE)
    args = p.parse_args(argv)
    unknown = set(args.setups) - set(SETUPS)
    if unknown:
        p.error(f"unknown setups {sorted(unknown)}; choose from {SETUPS}")
    if "vllm" in args.setups and not args.shape:
        p.error("the vllm setup needs --shape (a model directory both servers load)")
    if args.kv_blocks < 2:
        p.error("--kv-blocks must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, sweep._stop)  # so every `finally` stops its processes
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = asyncio.run(main_async(args))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
