"""Local etcd and NATS (JetStream) servers, for `kvrail up` and the test harness.

Both bind to 127.0.0.1 only, keep their data in a given directory and come up in about a second.
The binaries come from Debian (`etcd-server`, `nats-server`); `make setup` installs them.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kvrail.procs import ManagedProcess, free_port, http_ok

NATS_CANDIDATES = ("nats-server", "/usr/sbin/nats-server", "/usr/bin/nats-server")


def find_binary(name: str, *candidates: str) -> str:
    """Absolute path of a binary on PATH (or one of `candidates`); FileNotFoundError otherwise."""
    for candidate in (name, *candidates):
        found = shutil.which(candidate)
        if found:
            return found
    raise FileNotFoundError(
        f"{name} not found on PATH; run `make setup` (installs Debian's package)"
    )


def _supports_flag(binary: str, flag: str) -> bool:
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=10)
    return flag in out.stdout + out.stderr


@dataclass
class EtcdServer:
    """A single-member etcd on loopback."""

    data_dir: Path
    log_path: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    binary: str = field(default_factory=lambda: find_binary("etcd"))
    process: ManagedProcess | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name=node0",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.endpoint}",
            f"--advertise-client-urls={self.endpoint}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=node0={peer}",
            "--auto-compaction-retention=1",
            "--quota-backend-bytes=4294967296",
        ]
        if _supports_flag(self.binary, "--unsafe-no-fsync"):
            argv.append("--unsafe-no-fsync")
        self.process = ManagedProcess("etcd", argv, self.log_path).start()
        self.process.wait_ready(lambda: http_ok(self.endpoint + "/health"), timeout_s)
        return self

    def stop(self) -> None:
        if self.process:
            self.process.stop()


@dataclass
class NatsServer:
    """A nats-server with JetStream on loopback; `monitor_port` serves /healthz."""

    store_dir: Path
    log_path: Path
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    binary: str = field(default_factory=lambda: find_binary(*NATS_CANDIDATES))
    process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> NatsServer:
        # The one setting without a flag: messages up to kvrail.messages.MAX_MESSAGE_BYTES
        # (KV state replies of large pools); the default is 1 MiB.
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / "nats.conf"
        config.write_text("max_payload: 8MB\n")
        argv = [
            self.binary,
            "-c", str(config),
            "-a", "127.0.0.1",
            "-p", str(self.port),
            "-m", str(self.monitor_port),
            "-js",
            "-sd", str(self.store_dir),
        ]  # fmt: skip
        self.process = ManagedProcess("nats", argv, self.log_path).start()
        health = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        self.process.wait_ready(lambda: http_ok(health), timeout_s)
        return self

    def stop(self) -> None:
        if self.process:
            self.process.stop()
