"""`kvrail up`: the local stack, supervised until Ctrl-C or SIGTERM.

etcd and NATS, then the default model prepared once (a first run converts its GGUF file), then
one prefill worker, one decode worker and the router, each its own process. What it does, and
what a user can rely on:
- the router's port is checked before anything starts (a port in use is one clear error);
- readiness is read from what each process logged since this start (logs are appended across
  runs), so "serving" is printed only when the router answers;
- every component is supervised: one that exits is restarted with backoff (1 s, doubling to
  30 s; reset after a minute up), and a line says so;
- nothing it started survives it: a stop (Ctrl-C, SIGTERM, even SIGINT ignored by the shell
  that started it) stops everything within `STOP_GRACE_S`, and a `kill -9` of `kvrail up` takes
  every child with it (`ManagedProcess`'s parent-death signal);
- `<run dir>/stack.json` says where the stack's planes are, so `kvrail status` and `kvrail
  config` find them with no environment set.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvrail.errors import ConfigError
from kvrail.local.procs import ManagedProcess, ProcessFailed, port_in_use
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.settings import Settings

WORKERS = (("prefill-0", "prefill"), ("decode-0", "decode"))
"""The workers `kvrail up` starts, each its own process, then the router in front of them."""
PREPARE_TIMEOUT_S = 900.0  # a cold start converts the GGUF model first
READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 15.0
PROGRESS_EVERY_S = 5.0
RESTART_BACKOFF_S = (1.0, 30.0)
STABLE_AFTER_S = 60.0
STACK_FILE = "stack.json"
# The workers' own progress bars (transformers' GGUF conversion) would garble this terminal.
QUIET_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True, slots=True)
class StackInfo:
    """Where a running local stack's planes are; `pid` is its `kvrail up` process."""

    pid: int
    etcd_endpoint: str
    nats_url: str
    namespace: str
    pool: str
    router_url: str
    workers: tuple[str, ...]


def read_stack(run_dir: Path) -> StackInfo | None:
    """The stack running from `run_dir`, or None (no file, or its process is gone)."""
    try:
        data = json.loads((run_dir / STACK_FILE).read_text())
        info = StackInfo(**{**data, "workers": tuple(data["workers"])})
        os.kill(info.pid, 0)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return info


def with_stack_planes(settings: Settings, run_dir: Path) -> Settings:
    """`settings` pointed at the local stack's etcd, NATS and pool when it runs and the settings
    do not name their own; otherwise `settings` as they are."""
    info = read_stack(run_dir)
    explicit = settings.model_fields_set
    if info is None or {"etcd_endpoints", "nats_url"} & explicit:
        return settings
    changes: dict[str, Any] = {"etcd_endpoints": (info.etcd_endpoint,), "nats_url": info.nats_url}
    if "pool" not in explicit and "namespace" not in explicit:
        changes.update(namespace=info.namespace, pool=info.pool)
    return settings.model_copy(update=changes)


@dataclass
class _Supervised:
    """One component: how to start it, and its restart state."""

    name: str
    start: Callable[[], ManagedProcess]
    process: ManagedProcess | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = RESTART_BACKOFF_S[0]
    restart_at: float | None = None


@dataclass
class Stack:
    settings: Settings
    run_dir: Path
    say: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    _components: list[_Supervised] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    def run(self, check: bool = False) -> int:
        """Start, report, supervise until stopped (`check`: stop once everything is up)."""
        port = self.settings.http_port or 8000
        host = self.settings.router_host
        if port_in_use(host, port):
            raise ConfigError(
                f"port {port} on {host} is in use: stop what listens there, or pick another "
                "port with KVRAIL_HTTP_PORT"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / STACK_FILE).unlink(missing_ok=True)
        with self._signals():
            try:
                self._start_all(port)
                if check:
                    return 0
                self.say("kvrail up: press Ctrl-C to stop everything started here.")
                self._supervise()
                return 0
            finally:
                (self.run_dir / STACK_FILE).unlink(missing_ok=True)
                self._stop_all()
                self.say("kvrail up: stopped everything it started.")

    # -- starting -------------------------------------------------------------------------------

    def _start_all(self, port: int) -> None:
        self.say(f"kvrail up: starting etcd and NATS (data and logs in {self.run_dir})")
        etcd = EtcdServer(self.run_dir / "etcd", self.logs / "etcd.log")
        nats = NatsServer(self.run_dir / "nats", self.logs / "nats.log")
        self._add("etcd", lambda: _started(etcd.start()))
        self._add("NATS (JetStream)", lambda: _started(nats.start()))
        self.say(f"  etcd                 running  {etcd.endpoint}")
        self.say(f"  NATS (JetStream)     running  {nats.url}")
        env = {
            **os.environ, **QUIET_ENV, "KVRAIL_ETCD_ENDPOINTS": etcd.endpoint,
            "KVRAIL_NATS_URL": nats.url, "KVRAIL_NAMESPACE": self.settings.namespace,
            "KVRAIL_POOL": self.settings.pool, "KVRAIL_MODEL": self.settings.model,
            "KVRAIL_CACHE_DIR": str(self.settings.cache_dir),
        }  # fmt: skip
        env.pop("KVRAIL_HTTP_PORT", None)  # the router's port; workers serve no HTTP here
        if not Path("/dev/nvidiactl").exists():
            # One machine, KV in DRAM: UCX's shared-memory transport moved 3.5 GB/s here where
            # its default selection moved 1.7 GB/s (bench/transfer/handoff.py --device cpu).
            env.setdefault("UCX_TLS", "sm,self,tcp")
        self._prepare_model(env)
        for worker_id, role in WORKERS:
            argv = [sys.executable, "-P", "-m", "kvrail.worker", "--role", role,
                    "--worker-id", worker_id]  # fmt: skip
            self._add(f"{role} worker", self._process(f"{role} worker", argv, worker_id, env),
                      ready="worker ready", detail=worker_id)  # fmt: skip
        router_env = {**env, "KVRAIL_HTTP_PORT": str(port)}
        argv = [sys.executable, "-P", "-m", "kvrail.router"]
        url = f"http://{self.settings.router_host}:{port}"
        self._add(
            "router", self._process("router", argv, "router", router_env), ready="router ready",
            label="router (OpenAI API)", detail=f"{url}/v1",
        )  # fmt: skip
        info = StackInfo(
            os.getpid(), etcd.endpoint, nats.url, self.settings.namespace, self.settings.pool,
            url, tuple(w for w, _ in WORKERS),
        )  # fmt: skip
        (self.run_dir / STACK_FILE).write_text(json.dumps(asdict(info)) + "\n")
        self.say(curl_hint(url, self.settings))

    def _prepare_model(self, env: dict[str, str]) -> None:
        """Convert the model once, here, before the workers start (they would each convert it
        on a first run), with one progress line."""
        argv = [sys.executable, "-P", "-m", "kvrail.worker.models.loader", self.settings.model]
        proc = ManagedProcess("model", argv, self.logs / "model-prepare.log", env=env).start()
        started = time.monotonic()
        try:
            self._wait(
                proc,
                lambda: proc.returncode() == 0,
                PREPARE_TIMEOUT_S,
                started,
                f"preparing {self.settings.model} (a first run converts it: about 40 s)",
            )
        finally:
            proc.stop(grace_s=5)  # fmt: skip
        self.say(f"  model                ready    {time.monotonic() - started:.0f} s")

    def _process(
        self, name: str, argv: list[str], log_name: str, env: dict[str, str]
    ) -> Callable[[], ManagedProcess]:
        return lambda: ManagedProcess(name, argv, self.logs / f"{log_name}.log", env=env).start()

    def _add(
        self, name: str, start: Callable[[], ManagedProcess], ready: str = "", label: str = "",
        detail: str = "",
    ) -> None:  # fmt: skip
        """Start a component and supervise it; with `ready`, wait for that line in its log."""
        component = _Supervised(name, start)
        component.process = start()
        component.started_at = time.monotonic()
        self._components.append(component)
        if ready:
            proc = component.process
            self._wait(proc, lambda: ready in proc.log_text(), READY_TIMEOUT_S,
                       component.started_at, f"starting the {name}")  # fmt: skip
            seconds = time.monotonic() - component.started_at
            self.say(f"  {label or name:<20} running  {detail} ({seconds:.0f} s)")

    def _wait(
        self, proc: ManagedProcess, done: Callable[[], bool], timeout_s: float, since: float,
        what: str,
    ) -> None:  # fmt: skip
        """Wait for `done`; one progress line every `PROGRESS_EVERY_S` (rewritten in place on a
        terminal). Raises ProcessFailed when the process exits first or at the deadline."""
        deadline = since + timeout_s
        next_line = time.monotonic() + PROGRESS_EVERY_S
        while not done():
            if self._stop.is_set():
                raise ProcessFailed(f"stopped while {what}")
            if not proc.is_running() and not done():
                raise ProcessFailed(f"{proc.name} exited with {proc.returncode()}\n{proc.tail()}")
            now = time.monotonic()
            if now >= deadline:
                raise ProcessFailed(f"{proc.name} not ready after {timeout_s:.0f} s\n{proc.tail()}")
            if now >= next_line:
                next_line = now + PROGRESS_EVERY_S
                self._progress(f"    {what}: {now - since:.0f} s")
            self._stop.wait(0.2)
        self._progress(None)

    def _progress(self, line: str | None) -> None:
        if sys.stdout.isatty():
            sys.stdout.write("\r\033[K" + (line or ""))
            sys.stdout.flush()
        elif line is not None:
            self.say(line)

    # -- supervising and stopping ---------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            for c in self._components:
                self._check(c, now)

    def _check(self, c: _Supervised, now: float) -> None:
        if c.restart_at is not None:
            if now >= c.restart_at:
                c.restart_at = None
                try:
                    c.process = c.start()
                except (ProcessFailed, OSError) as err:
                    self.say(f"kvrail up: the {c.name} did not restart: {str(err).splitlines()[0]}")
                    self._schedule_restart(c, now)
                    return
                c.started_at = now
                self.say(f"kvrail up: the {c.name} restarted (restart {c.restarts})")
            return
        if c.process is None or c.process.is_running():
            if now - c.started_at > STABLE_AFTER_S:
                c.backoff_s = RESTART_BACKOFF_S[0]
            return
        code = c.process.returncode()
        self.say(f"kvrail up: the {c.name} exited with {code}; restarting in {c.backoff_s:.0f} s "
                 f"(log: {c.process.log_path})")  # fmt: skip
        self._schedule_restart(c, now)

    def _schedule_restart(self, c: _Supervised, now: float) -> None:
        c.restarts += 1
        c.restart_at = now + c.backoff_s
        c.backoff_s = min(c.backoff_s * 2, RESTART_BACKOFF_S[1])

    def _stop_all(self) -> None:
        """Stop the router, then every worker at once, then NATS and etcd, all within
        `STOP_GRACE_S`; what is still running then is killed."""
        deadline = time.monotonic() + STOP_GRACE_S
        processes = [c.process for c in reversed(self._components) if c.process is not None]
        servers = [p for p in processes if p.name in ("etcd", "nats")]
        others = [p for p in processes if p not in servers]
        for group in (others, servers):
            for p in group:
                p.kill(signal.SIGTERM)
            for p in group:
                p.stop(grace_s=max(deadline - time.monotonic(), 0.5))

    @contextmanager
    def _signals(self) -> Iterator[None]:
        """Ctrl-C and SIGTERM stop the stack, whatever dispositions it inherited (a background
        job of a non-interactive shell starts with SIGINT ignored)."""
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def stop(*_: object) -> None:
            self._stop.set()

        for s in previous:
            signal.signal(s, stop)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _started(server: EtcdServer | NatsServer) -> ManagedProcess:
    assert server.process is not None
    return server.process


def curl_hint(url: str, settings: Settings) -> str:
    from kvrail.model_files import resolve

    name = settings.served_model_name or resolve(settings.model).served_name
    body = (
        f'{{"model": "{name}", "max_tokens": 32, "temperature": 0, '
        '"messages": [{"role": "user", "content": "What is the capital of France?"}]}'
    )
    return (
        f"kvrail up: serving {name}. Try:\n\n"
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n"
    )
