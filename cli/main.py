"""The `kvrail` command. It starts components by module name and never imports them.

kvrail up            the local one-machine stack (what `make run` starts)
kvrail model prepare convert the default model once and cache it (fast warm loads)
kvrail config        print the resolved settings
kvrail version
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aetcd

from kvrail import __version__
from kvrail.errors import KvrailError
from kvrail.local.procs import ProcessFailed
from kvrail.settings import Settings, load_settings

log = logging.getLogger("kvrail")

# The workers `kvrail up` starts, each its own process, then the router in front of them.
UP_WORKERS = (("prefill-0", "prefill"), ("decode-0", "decode"))
WORKER_READY_TIMEOUT_S = 900.0  # a cold start converts the GGUF model first (~35 s here)
ROUTER_READY_TIMEOUT_S = 300.0
PROGRESS_EVERY_S = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrail", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, help="YAML settings file (else $KVRAIL_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the local stack (etcd, NATS, workers, router)")
    up.add_argument("--run-dir", type=Path, help="data and logs (default: <cache_dir>/run)")
    up.add_argument("--check", action="store_true", help="start, report, stop (no serving loop)")
    model = sub.add_parser("model", help="model cache")
    model.add_argument("action", choices=["prepare"])
    status = sub.add_parser("status", help="pools, workers and prefill queues")
    status.add_argument("--all-pools", action="store_true", help="every pool, not only mine")
    sub.add_parser("config", help="print the resolved settings")
    sub.add_parser("version")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = load_settings(args.config)
        if args.command == "up":
            return _up(settings, args.run_dir or settings.cache_dir / "run", args.check)
        if args.command == "model":
            return _prepare_model(settings)
        if args.command == "status":
            print(asyncio.run(_status(settings, args.all_pools)), end="")
            return 0
        if args.command == "config":
            print(settings.model_dump_json(indent=2))
            return 0
        print(f"kvrail {__version__}")
        return 0
    except KvrailError as err:
        print(f"kvrail: error: {err}", file=sys.stderr)
        return 2
    except ProcessFailed as err:
        print(f"kvrail: error: {err}", file=sys.stderr)
        return 1


async def _status(settings: Settings, all_pools: bool) -> str:
    from kvrail.bus import connect
    from kvrail.cli.status import collect, render
    from kvrail.keys import PoolKeys
    from kvrail.registry import etcd_client

    pool = None if all_pools else PoolKeys(settings.namespace, settings.pool)
    try:
        nc = await asyncio.wait_for(connect(settings, name="kvrail-status"), timeout=10)
    except (OSError, TimeoutError) as err:
        raise KvrailError(f"cannot reach NATS at {settings.nats_url}: {err}") from err
    try:
        async with etcd_client(settings) as etcd:
            return render(await asyncio.wait_for(collect(etcd, nc.jetstream(), pool), 15))
    except (OSError, TimeoutError, aetcd.exceptions.ClientError) as err:
        raise KvrailError(f"cannot read etcd at {settings.etcd_endpoints[0]}: {err}") from err
    finally:
        await nc.close()


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _prepare_model(settings: Settings) -> int:
    module = "kvrail.worker.models.loader"
    if not _module_exists(module):
        print(f"kvrail: the model loader ({module}) is not built yet", file=sys.stderr)
        return 1
    env = {**os.environ, "KVRAIL_CACHE_DIR": str(settings.cache_dir)}
    argv = [sys.executable, "-P", "-m", module, settings.model]
    return subprocess.run(argv, check=False, env=env).returncode


def _up(settings: Settings, run_dir: Path, check: bool) -> int:
    # Imported here: `kvrail config` and `kvrail version` need no server binaries.
    from kvrail.local.procs import ManagedProcess
    from kvrail.local.servers import EtcdServer, NatsServer

    run_dir.mkdir(parents=True, exist_ok=True)
    logs = run_dir / "logs"
    etcd = EtcdServer(run_dir / "etcd", logs / "etcd.log")
    nats = NatsServer(run_dir / "nats", logs / "nats.log")
    procs: list[ManagedProcess] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    port = settings.http_port or 8000
    try:
        print(f"kvrail up: starting etcd and NATS (data and logs in {run_dir})", flush=True)
        etcd.start()
        nats.start()
        print(f"  etcd                 running  {etcd.endpoint}")
        print(f"  NATS (JetStream)     running  {nats.url}", flush=True)
        env = {
            **os.environ, "KVRAIL_ETCD_ENDPOINTS": etcd.endpoint, "KVRAIL_NATS_URL": nats.url,
            "KVRAIL_NAMESPACE": settings.namespace, "KVRAIL_POOL": settings.pool,
            "KVRAIL_MODEL": settings.model, "KVRAIL_CACHE_DIR": str(settings.cache_dir),
        }  # fmt: skip
        env.pop("KVRAIL_HTTP_PORT", None)  # the router's port; workers serve no HTTP here
        if not Path("/dev/nvidiactl").exists():
            # One machine, KV in DRAM: UCX's shared-memory transport moved 3.5 GB/s here where
            # its default selection moved 1.7 GB/s (bench/transfer/handoff.py --device cpu).
            env.setdefault("UCX_TLS", "sm,self,tcp")
        for worker_id, role in UP_WORKERS:
            argv = [sys.executable, "-P", "-m", "kvrail.worker", "--role", role,
                    "--worker-id", worker_id]  # fmt: skip
            log_path = logs / f"{worker_id}.log"
            procs.append(ManagedProcess(f"{role} worker", argv, log_path, env=env).start())
        print(f"kvrail up: loading {settings.model} in the workers (logs in {logs})", flush=True)
        for (worker_id, role), proc in zip(UP_WORKERS, procs, strict=True):
            _wait_with_progress(proc, "worker ready", WORKER_READY_TIMEOUT_S)
            print(f"  {role + ' worker':<20} running  {worker_id}", flush=True)
        router_env = {**env, "KVRAIL_HTTP_PORT": str(port)}
        argv = [sys.executable, "-P", "-m", "kvrail.router"]
        router = ManagedProcess("router", argv, logs / "router.log", env=router_env).start()
        procs.append(router)
        _wait_with_progress(router, "router ready", ROUTER_READY_TIMEOUT_S)
        url = f"http://{settings.router_host}:{port}"
        print(f"  router (OpenAI API)  running  {url}/v1", flush=True)
        print(_curl_hint(url, settings), flush=True)
        if check:
            return 0
        print("kvrail up: press Ctrl-C to stop everything started here.", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop(grace_s=30)
        nats.stop()
        etcd.stop()
        print("kvrail up: stopped everything it started.", flush=True)


def _curl_hint(url: str, settings: Settings) -> str:
    from kvrail.model_files import resolve

    name = settings.served_model_name or resolve(settings.model).served_name
    body = (
        f'{{"model": "{name}", "max_tokens": 32, '
        '"messages": [{"role": "user", "content": "What is the capital of France?"}]}'
    )
    return (
        f"kvrail up: serving {name}. Try:\n\n"
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n"
    )


def _wait_with_progress(proc: Any, marker: str, timeout_s: float) -> None:
    """Wait for `marker` in the process's log, printing its latest log line now and then."""
    import time

    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    while True:
        remaining = deadline - time.monotonic()
        try:
            proc.wait_ready(_logged(marker, proc.log_path), min(PROGRESS_EVERY_S, remaining), 0.25)
            return
        except ProcessFailed:
            if not proc.is_running() or time.monotonic() >= deadline:
                raise
        last = _last_line(proc.log_path)
        print(f"    {proc.name}: {time.monotonic() - started:4.0f} s  {last}", flush=True)


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    # "<date> <time> LEVEL logger message": show the message only, cut to one terminal line.
    text = lines[-1].split(" ", 4)[-1] if lines else "starting"
    return text[:100]


def _logged(marker: str, path: Path) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return marker in path.read_text(errors="replace")
        except OSError:
            return False

    return check


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
