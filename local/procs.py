"""Child processes with logs, readiness checks and a clean stop.

Used by `kvrail up` (the local stack) and by the test harness (real etcd, NATS and Kubernetes
servers). Each process runs in its own session so that a stop reaches its whole process group,
writes stdout and stderr to one log file (appended to; `log_text()` is this start's part), and is
stopped with SIGTERM, then SIGKILL after a grace period. Every wait has a deadline. A child is
also killed when the thread that started it dies, however it dies (Linux's parent-death signal):
nothing outlives what started it, not even a `kill -9` of that.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """Ask the kernel to SIGKILL this process when its parent dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for a bind to port 0 or an outgoing connection."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


# free_port() hands out ports below the kernel's ephemeral range. A port the kernel picked for a
# bind to port 0 is free only until the child binds it; meanwhile any process's outgoing
# connection or its own bind to port 0 (vLLM's internal ZMQ sockets did, in CI) may take it. The
# kernel never picks a port below the range, so only another explicit choice can collide: a
# random start per process, a step per call and a bind check make that rare.
_PORTS_LOW = 20000
_ports_high = min(_ephemeral_low(), 30000)
if _ports_high - _PORTS_LOW < 1000:
    _PORTS_LOW = 1024  # a machine whose ephemeral range starts low: use what lies below it
_port_lock = threading.Lock()
_port_next = _PORTS_LOW + random.SystemRandom().randrange(max(_ports_high - _PORTS_LOW, 1))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that the kernel never assigns on its own.

    Successive calls in one process never repeat a port until the whole window was used.
    """
    global _port_next
    size = _ports_high - _PORTS_LOW
    with _port_lock:
        for _ in range(size):
            port = _port_next
            _port_next = _PORTS_LOW + (_port_next - _PORTS_LOW + 1) % size
            with socket.socket() as s:
                try:  # the wildcard address: a port taken on any local address is refused
                    s.bind(("0.0.0.0", port))
                except OSError:
                    continue
            return port
    raise OSError(f"no free TCP port on 127.0.0.1 in {_PORTS_LOW}-{_ports_high - 1}")


class ProcessFailed(RuntimeError):
    """A managed process exited or did not become ready; the message holds its log's tail."""


class ManagedProcess:
    """One child process. Not started until `start()`; `stop()` is idempotent."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> ManagedProcess:
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self._log_offset = out.tell()
            self._proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        log.info("process started name=%s pid=%d log=%s", self.name, self._proc.pid, self.log_path)
        return self

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_ready(
        self, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.1
    ) -> None:
        """Poll `check` until it returns True; raise ProcessFailed on exit or at the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_running():
                raise ProcessFailed(f"{self.name} exited with {self.returncode()}\n{self.tail()}")
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(interval_s)
        raise ProcessFailed(f"{self.name} not ready after {timeout_s:.0f}s\n{self.tail()}")

    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the whole process group (kill -9 by default, for fault tests)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, sig)

    def stop(self, grace_s: float = 10.0) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("process did not stop name=%s grace_s=%.0f; killing", self.name, grace_s)
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=grace_s)
        except ProcessLookupError:
            pass

    def log_text(self) -> str:
        """What this start of the process wrote to its log (not what earlier runs appended)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, num_lines: int = 40) -> str:
        lines = self.log_text().splitlines()
        if not lines and not self.log_path.exists():
            return f"(no log at {self.log_path})"
        return "\n".join(f"  {self.name}| {line}" for line in lines[-num_lines:])


def http_ok(url: str, timeout_s: float = 1.0, context: ssl.SSLContext | None = None) -> bool:
    """True when GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def port_in_use(host: str, port: int) -> bool:
    """Whether binding `host:port` fails now (another process listens there)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
