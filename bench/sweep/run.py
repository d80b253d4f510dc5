"""Request-rate sweeps on one or two GPUs: colocated vs disaggregated, goodput under SLOs.

    source hack/device-env.sh        # on the lent H200 (README.md says what travels with it)
    python3 -P bench/sweep/run.py --setups colocated --out $OUT/colocated.json
    python3 -P bench/sweep/run.py --setups disaggregated --out $OUT/disaggregated.json
    python3 -P bench/sweep/report.py $OUT/*.json --out bench/sweep/results-h200.json \\
        --plot bench/sweep/sweep-h200.png
    .venv/bin/python -P bench/sweep/run.py --smoke --out /tmp/sweep-smoke.json   # CPU check
    .venv/bin/python -P bench/sweep/run.py --cpu --shape tiny ...   # any sweep, on the CPU

What runs, per setup: real etcd and NATS (`kvrail.local.servers`), a fresh pool of real worker
processes (`python -P -m kvrail.worker`, through `kvrail.testing.pool.LocalPool`) and the router,
all on this machine, then the load generator (`bench/loadgen/`, imported) against the router's
OpenAI endpoint. The setups (`worker_specs`): `colocated` (one `colocated` worker, chunked prefill),
`disaggregated` (a prefill and a decode process on one GPU), and with `--gpus 2` `colocated-x2` (a
`colocated` worker per GPU) and `disaggregated-x2` (prefill on GPU 0, decode on GPU 1); `vllm` is
`vllm serve` on the same model directory, driven by the same client, requests and seeds, so its
goodput is judged by the same rule (`--vllm-python`, `--vllm-pythonpath`). The kvrail setups
run `--routers` router processes on ports of their own, and the load generator runs in
`--client-processes` processes, each sending to one router in turn. A worker on
GPU g gets `CUDA_VISIBLE_DEVICES=g,<the others>`: g is its current device, and the others stay
visible, as CUDA IPC to a peer on another GPU needs. The model (`model.py`) is the Llama-3-8B shape
with random bf16 weights and a synthetic word-level tokenizer, so every generated token is one
streamed chunk and every request runs to its max_tokens.

Workloads (`--workloads`, `long` and `chat`) run at several Poisson rates each, interleaved (so a
run cut short by `--budget-s` still covers both), every point with its own seed (the prefix cache
never helps) and `--warmup` unmeasured requests; each workload first gets a warm-up load (Triton
compiles on first use). Goodput is loadgen's (TTFT <= `--slo-ttft-s` and the request's own ITL
p99 <= `--slo-itl-s`). The JSON (`--out`, rewritten after every point) holds the configuration,
versions, GPU memory and per point every request plus what the workers logged about the measured
ones (`observe.py`). README.md has the setups, workloads and results in full.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import sys
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from kvrail.local.procs import ManagedProcess, free_port, http_ok
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool
from kvrail.testing.scripts import load_script

HERE = Path(__file__).resolve().parent
lg = load_script("kvrail_bench_loadgen", HERE.parent / "loadgen" / "__init__.py")
randmodel = load_script("kvrail_bench_sweep_model", HERE / "model.py")
observe = load_script("kvrail_bench_sweep_observe", HERE / "observe.py")

SETUPS = ("colocated", "disaggregated", "colocated-x2", "disaggregated-x2", "vllm")
BLOCK_SIZE = 16


# -- the plan (pure) -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sweep:
    """One workload at several rates."""

    name: str
    prompt_tokens: Any  # lg.Lengths
    output_tokens: Any  # lg.Lengths
    rates: tuple[float, ...]
    num_requests: int
    tail_s: float
    """A guess of how long a point's last requests take after the last arrival (for the budget)."""


@dataclass(frozen=True, slots=True)
class Point:
    sweep: Sweep
    rate: float
    index: int
    """The point's position in its sweep; with the sweep's name it seeds the requests."""

    def seed(self, base: int) -> int:
        return base + 1000 * (1 + ("long", "chat").index(self.sweep.name)) + self.index

    def estimate_s(self, num_warmup: int) -> float:
        return (num_warmup + self.sweep.num_requests) / self.rate + self.sweep.tail_s


def interleave(sweeps: list[Sweep]) -> list[Point]:
    """Points in the order they run: each sweep's first rate, then each one's second, ..."""
    depth = max((len(s.rates) for s in sweeps), default=0)
    return [Point(s, s.rates[k], k) for k in range(depth) for s in sweeps if k < len(s.rates)]


def visible_devices(gpu: int, num_gpus: int) -> str:
    """CUDA_VISIBLE_DEVICES for a worker on GPU `gpu` of `num_gpus`: that GPU first (the worker's
    `cuda`), then the others, which stay visible for CUDA IPC to peers on them."""
    if not 0 <= gpu < num_gpus:
        raise ValueError(f"GPU {gpu} is not one of the {num_gpus} GPUs (--gpus)")
    return ",".join(str(g) for g in [gpu, *(g for g in range(num_gpus) if g != gpu)])


def worker_specs(setup: str, args: argparse.Namespace) -> list[tuple[str, str, dict[str, str]]]:
    """(worker id, role, its own settings) of each worker of `setup`; in the `-x2` setups these
    include the worker's CUDA_VISIBLE_DEVICES."""
    decode = {
        "KVRAIL_MAX_NUM_BATCHED_TOKENS": str(args.chunk_tokens),
        "KVRAIL_NUM_KV_BLOCKS": str(args.kv_blocks),
    }
    colocated = {**decode, "KVRAIL_DISAGGREGATION_MODE": "colocated"}
    prefill = {
        "KVRAIL_MAX_NUM_BATCHED_TOKENS": str(args.prefill_tokens),
        "KVRAIL_NUM_KV_BLOCKS": str(args.prefill_kv_blocks),
    }
    decode["KVRAIL_MIN_REMOTE_PREFILL_TOKENS"] = str(args.min_remote_prefill_tokens)
    if setup == "colocated":
        return [("colocated-0", "colocated", colocated)]
    if setup == "disaggregated":
        return [("prefill-0", "prefill", prefill), ("decode-0", "decode", decode)]

    def on(gpu: int, env: dict[str, str]) -> dict[str, str]:
        return {**env, "CUDA_VISIBLE_DEVICES": visible_devices(gpu, args.gpus)}

    if setup == "colocated-x2":
        return [
            ("colocated-0", "colocated", on(0, colocated)),
            ("colocated-1", "colocated", on(1, colocated)),
        ]
    if setup == "disaggregated-x2":
        return [("prefill-0", "prefill", on(0, prefill)), ("decode-0", "decode", on(1, decode))]
    if setup == "vllm":
        return []  # no kvrail worker: `vllm_argv`'s server answers instead
    raise ValueError(f"unknown setup {setup!r}; choose from {SETUPS}")


def vllm_argv(args: argparse.Namespace, model_dir: Path, port: int) -> list[str]:
    """The `vllm` setup's server: vLLM's OpenAI server on the same model directory (the same
    random weights and tokenizer as the kvrail workers load), its own defaults otherwise, and
    `--vllm-args` last (a later flag wins)."""
    return [
        _absolute(args.vllm_python), "-P", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir.absolute()), "--served-model-name", model_dir.name,
        "--max-model-len", str(args.max_model_len), "--seed", "0", "--host", "127.0.0.1",
        "--port", str(port), *shlex.split(args.vllm_args),
    ]  # fmt: skip


def _absolute(program: str) -> str:
    """A path with a folder in it, absolute (the server runs in a folder of its own); a bare name
    is left to PATH. Not resolved: a virtual environment's python is a link into its base."""
    return str(Path(program).absolute()) if os.sep in program else program


def vllm_server_facts(log: str) -> dict[str, Any]:
    """What vLLM's log says about the server that ran: its version and whether its prefix cache
    was on (the sweep's seeds keep it from helping, but the record says it was there)."""
    version = re.search(r"LLM engine \(v([\w.+-]+)\)", log)
    caching = re.search(r"enable_prefix_caching=(True|False)", log)
    return {"vllm_version": version.group(1) if version else None,
            "prefix_caching": caching.group(1) == "True" if caching else None}  # fmt: skip


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """The vLLM server's environment: this one, with PYTHONPATH set to `--vllm-pythonpath` where
    given (the folder holding vLLM and its pinned packages, not the sweep's own)."""
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if args.vllm_pythonpath is not None:
        env["PYTHONPATH"] = args.vllm_pythonpath
    return env


# -- one setup -------------------------------------------------------------------------------------


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


async def run_setup(
    setup: str, etcd: EtcdServer, nats: NatsServer, root: Path, model_dir: Path,
    args: argparse.Namespace, result: dict[str, Any], started: float,
) -> None:  # fmt: skip
    """Start `setup`'s pool, warm it up, run every point that fits the budget, stop the pool.
    Appends to `result["setups"]` and rewrites `args.out` after every point."""
    common = {
        "KVRAIL_MODEL": str(model_dir),
        "KVRAIL_MAX_MODEL_LEN": str(args.max_model_len),
        "KVRAIL_BLOCK_SIZE": str(BLOCK_SIZE),
        "KVRAIL_REQUEST_TIMEOUT_S": "600",
        "KVRAIL_LOG_LEVEL": "INFO",
        "KVRAIL_TORCH_NUM_THREADS": str(args.torch_threads),
    }
    specs = worker_specs(setup, args)
    entry: dict[str, Any] = {
        "setup": setup + args.tag, "workers": [{"id": w, "role": r, "env": e} for w, r, e in specs],
        "common_env": common, "points": [], "skipped": [], "warmups": [],
    }  # fmt: skip
    result["setups"].append(entry)
    pool = LocalPool(etcd, nats, root / setup, f"sweep-{setup[:6]}-{uuid.uuid4().hex[:6]}", common)
    (root / setup).mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(args.routers if setup != "vllm" else 1)]
    port = ports[0]
    vllm: ManagedProcess | None = None
    t0 = time.monotonic()
    try:
        if setup == "vllm":
            argv = vllm_argv(args, model_dir, port)
            entry["server"] = {"argv": argv, "pythonpath": args.vllm_pythonpath}
            # its own folder as the working directory: vLLM's helper processes run `python -m`
            # without -P, and this repository's `operator/` would shadow the standard library's
            vllm = ManagedProcess("vllm", argv, root / setup / "vllm.log", vllm_env(args),
                                  cwd=root / setup).start()  # fmt: skip
            health = f"http://127.0.0.1:{port}/health"
            await asyncio.to_thread(vllm.wait_ready, lambda: http_ok(health), args.ready_timeout_s,
                                    1.0)  # fmt: skip
            entry["server"].update(vllm_server_facts(vllm.log_text()))
        for worker_id, role, env in specs:
            pool.start(worker_id, role, **env)
        for worker_id, _, _ in specs:
            await asyncio.to_thread(pool.wait_ready, worker_id, args.ready_timeout_s)
        if vllm is None:  # router processes, each on its own port (as replicas would be)
            for i, router_port in enumerate(ports):
                pool.start_router(f"router-{i}", KVRAIL_HTTP_PORT=str(router_port))
            for i in range(len(ports)):
                await asyncio.to_thread(pool.wait_ready, f"router-{i}", 120)
        entry["pool_ready_s"] = time.monotonic() - t0
        entry["gpu_memory_ready"] = observe.gpu_memory()
        print(f"{setup}: pool ready in {entry['pool_ready_s']:.0f}s "
              f"gpu={entry['gpu_memory_ready']}", file=sys.stderr, flush=True)  # fmt: skip
        replicas = [f"http://127.0.0.1:{other}/v1" for other in ports[1:]]
        target = lg.Target(f"http://127.0.0.1:{port}/v1", model_dir.name, temperature=0.0,
                           timeout_s=600.0)  # fmt: skip
        slo = lg.Slo(ttft_s=args.slo_ttft_s, itl_s=args.slo_itl_s, itl_stat="p99")
        sweeps = make_sweeps(args)
        for sweep in sweeps:  # warm-up: Triton compiles on first use; unmeasured
            if args.warmup_requests <= 0:
                continue
            workload = lg.Workload(sweep.prompt_tokens, sweep.output_tokens, seed=args.seed + 99)
            rate = sweep.rates[min(1, len(sweep.rates) - 1)]
            point = lg.LoadPoint("poisson", rate=rate, num_requests=args.warmup_requests)
            w0 = time.monotonic()
            [report] = await lg.run(target, workload, [point], slo)
            entry["warmups"].append({"sweep": sweep.name, "seconds": time.monotonic() - w0,
                                     "summary": report["summary"]})  # fmt: skip
            print(f"{setup}: warm-up {sweep.name} done in {time.monotonic() - w0:.0f}s",
                  file=sys.stderr, flush=True)  # fmt: skip
        for p in interleave(sweeps):
            elapsed = time.monotonic() - started
            if args.budget_s and elapsed + p.estimate_s(args.warmup) > args.budget_s:
                entry["skipped"].append({"sweep": p.sweep.name, "rate": p.rate,
                                         "reason": f"budget: {elapsed:.0f}s used"})  # fmt: skip
                continue
            workload = lg.Workload(p.sweep.prompt_tokens, p.sweep.output_tokens,
                                   seed=p.seed(args.seed))  # fmt: skip
            point = lg.LoadPoint("poisson", rate=p.rate, num_requests=p.sweep.num_requests,
                                 num_warmup=args.warmup)  # fmt: skip
            [report] = await lg.run(target, workload, [point], slo,
                                    processes=args.client_processes, replicas=replicas)  # fmt: skip
            if report["client"]["bound"]:
                busy = report["client"]["busiest_cpu_fraction"]
                print(f"{setup}: the busiest client process was {busy:.0%} busy at {p.rate:g}/s: "
                      "its gaps overstate the server's (--client-processes)",
                      file=sys.stderr, flush=True)  # fmt: skip
            logged: dict[str, dict[str, Any]] = {}
            for worker_id, _, _ in specs:
                for rid, seen in observe.parse_worker_log(
                    pool.procs[worker_id].log_path.read_text()
                ).items():
                    if "mode" in seen:  # its `first token` line: this worker decodes it
                        seen["decode_worker"] = worker_id
                    logged.setdefault(rid, {}).update(seen)
            report["sweep"] = p.sweep.name
            report["servers"] = observe.server_summary(report["requests"], logged)
            entry["points"].append(report)
            write_json(args.out, result)
            print(f"{setup} {p.sweep.name}:\n{lg.table([report])}", file=sys.stderr, flush=True)
        entry["gpu_memory_end"] = observe.gpu_memory()
    finally:
        if vllm is not None:
            await asyncio.to_thread(vllm.stop, 60.0)
        await asyncio.to_thread(pool.stop)
        entry["seconds"] = time.monotonic() - t0
        write_json(args.out, result)


def make_sweeps(args: argparse.Namespace) -> list[Sweep]:
    known = {
        "long": Sweep("long", args.long_prompt, args.long_output, tuple(args.long_rates),
                      args.long_requests, args.long_tail_s),
        "chat": Sweep("chat", args.chat_prompt, args.chat_output, tuple(args.chat_rates),
                      args.chat_requests, args.chat_tail_s),
    }  # fmt: skip
    return [known[name] for name in args.workloads]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="kvrail-bench-sweep-"))
    print(f"logs in {root}", file=sys.stderr, flush=True)
    device = "cpu" if args.smoke or args.cpu else "cuda"
    m0 = time.monotonic()
    info = randmodel.write_model_dir(args.model_dir, args.shape, lg.WORDS, device=device)
    info["write_s"] = time.monotonic() - m0
    print(f"model dir {args.model_dir} ready in {info['write_s']:.0f}s: {info}", file=sys.stderr,
          flush=True)  # fmt: skip
    config = {k: str(v) if isinstance(v, lg.Lengths | Path) else v for k, v in vars(args).items()}
    result: dict[str, Any] = {
        "command": "python -P bench/sweep/run.py " + " ".join(sys.argv[1:]),
        "started_unix_s": time.time(), "config": config, "model": info,
        "versions": observe.versions(), "setups": [],
        "machine": {**lg.machine(), "gpu": observe.gpu_memory()},
    }  # fmt: skip
    etcd = EtcdServer(root / "etcd", root / "etcd.log").start()
    nats = NatsServer(root / "js", root / "nats.log").start()
    try:
        for setup in args.setups:
            await run_setup(setup, etcd, nats, root, args.model_dir, args, result, started)
    finally:
        nats.stop()
        etcd.stop()
        result["wall_s"] = time.monotonic() - started
        write_json(args.out, result)
        if args.logs:
            with tarfile.open(args.logs, "w:gz") as tar:
                tar.add(root, arcname="logs", filter=lambda t: None if "/js" in t.name or
                        "/etcd/" in t.name else t)  # fmt: skip
    return result


# -- command line ----------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--cpu",
        action="store_true",
        help="write the model on the CPU (a machine without a GPU; workers run there)",
    )
    p.add_argument("--smoke", action="store_true",
                   help="CPU: SmolLM2-135M shape, tiny prompts, few requests")  # fmt: skip
    p.add_argument("--setups", type=lambda t: t.split(","), default=list(SETUPS[:2]))
    p.add_argument("--gpus", type=int, default=1,
                   help="GPUs on this machine (ids 0..n-1); the -x2 setups need 2")  # fmt: skip
    p.add_argument("--workloads", type=lambda t: t.split(","), default=["long", "chat"])
    p.add_argument("--out", type=Path, default=Path("sweep.json"))
    p.add_argument("--logs", type=Path, help="a .tar.gz of every process's log")
    p.add_argument("--budget-s", type=float, help="skip points that would end after this")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(randmodel.SHAPES))
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/kvrail-sweep/llama3-8b-random"))
    p.add_argument("--max-model-len", type=int, default=8704)
    p.add_argument("--chunk-tokens", type=int, default=2048,
                   help="token budget per step of the colocated and the decode worker")  # fmt: skip
    p.add_argument("--prefill-tokens", type=int, default=8704, help="prefill worker's budget")
    p.add_argument("--kv-blocks", type=int, default=24576,
                   help="KV blocks (2 MiB each at 8B) of the colocated/decode worker")  # fmt: skip
    p.add_argument("--prefill-kv-blocks", type=int, default=12288)
    p.add_argument("--min-remote-prefill-tokens", type=int, default=512)
    p.add_argument("--torch-threads", type=int, default=4)
    p.add_argument("--long-prompt", type=lg.Lengths.parse, default=lg.Lengths(8192, 8192))
    p.add_argument("--long-output", type=lg.Lengths.parse, default=lg.Lengths(256, 256))
    p.add_argument("--long-rates", type=_floats, default=[0.5, 1.0, 2.0, 4.0])
    p.add_argument("--long-requests", type=int, default=32)
    p.add_argument("--long-tail-s", type=float, default=15.0)
    p.add_argument("--chat-prompt", type=lg.Lengths.parse, default=lg.Lengths(200, 1000))
    p.add_argument("--chat-output", type=lg.Lengths.parse, default=lg.Lengths(100, 300))
    p.add_argument("--chat-rates", type=_floats, default=[4.0, 8.0, 16.0, 32.0])
    p.add_argument("--chat-requests", type=int, default=160)
    p.add_argument("--chat-tail-s", type=float, default=10.0)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per point")
    p.add_argument("--warmup-requests", type=int, default=8, help="per workload, per setup")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-itl-s", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="appended to the setup's name in the results")
    p.add_argument("--routers", type=int, default=1,
                   help="router processes, each on its own port (kvrail setups)")  # fmt: skip
    p.add_argument(
        "--client-processes",
        type=int,
        help="load generator processes per point (default 4, or 1 on a CPU)",
    )
    p.add_argument("--vllm-python", default=sys.executable,
                   help="the `vllm` setup: the Python that has vLLM")  # fmt: skip
    p.add_argument("--vllm-pythonpath", help="the `vllm` setup: its server's PYTHONPATH")
    p.add_argument("--vllm-args", default="",
                   help="the `vllm` setup: more server flags, e.g. '--dtype float32'")  # fmt: skip
    args = p.parse_args(argv)
    if args.client_processes is None:
        args.client_processes = 1 if args.smoke or args.cpu else 4
    if args.routers < 1:
        p.error("--routers must be at least 1")
    if args.client_processes < args.routers:
        p.error("--client-processes must be at least --routers (a client process per router)")
    if args.smoke:
        args.shape, args.max_model_len = "smollm2-135m", 512
        args.model_dir = Path(tempfile.gettempdir()) / "kvrail-sweep" / "smollm2-135m-random"
        args.chunk_tokens, args.prefill_tokens = 64, 512
        args.kv_blocks, args.prefill_kv_blocks, args.torch_threads = 256, 128, 1
        args.min_remote_prefill_tokens = 64
        args.long_prompt, args.long_output = lg.Lengths(160, 160), lg.Lengths(8, 8)
        args.long_rates, args.long_requests, args.long_tail_s = [0.5], 3, 10.0
        args.chat_prompt, args.chat_output = lg.Lengths(16, 48), lg.Lengths(4, 8)
        args.chat_rates, args.chat_requests, args.chat_tail_s = [1.0, 2.0], 4, 5.0
        args.warmup, args.warmup_requests = 1, 2
        args.slo_ttft_s, args.slo_itl_s = 5.0, 1.0
        args.gpus = max(args.gpus, 2)  # on the CPU the -x2 setups run their process layout
    unknown = set(args.setups) - set(SETUPS) or set(args.workloads) - {"long", "chat"}
    if unknown:
        p.error(f"unknown setups or workloads: {sorted(unknown)}")
    if args.gpus < 2 and any(s.endswith("-x2") for s in args.setups):
        p.error("the -x2 setups need --gpus 2 (or more)")
    return args


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so every `finally` stops its processes


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, _stop)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = asyncio.run(main_async(args))
    report = load_script("kvrail_bench_sweep_report", HERE / "report.py")
    print(report.markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
