"""Local etcd and NATS (JetStream) servers, for `kvrail up` and the test harness.

Both bind to 127.0.0.1 only, keep their data in a given directory and come up in about a second.
The binaries come from Debian (`etcd-server`, `nats-server`); `make setup` installs them.

Both are plaintext without authentication unless given a `ServingCert` (TLS: `https://` etcd,
`tls://` NATS) and a password file (etcd: user `root`, set up through etcd's auth API on first
start; NATS: `user`, from its config file, the password from the environment). `client_env()`
is what a kvrail process needs to reach them, as `KVRAIL_*` settings.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kvrail.local.procs import ManagedProcess, free_port, http_ok
from kvrail.nats_auth import quoted
from kvrail.settings import read_secret
from kvrail.tls import ServingCert

ETCD_ROOT = "root"

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
    """A single-member etcd on loopback; TLS with `tls`, auth (user root) with `password_file`."""

    data_dir: Path
    log_path: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    binary: str = field(default_factory=lambda: find_binary("etcd"))
    process: ManagedProcess | None = None
    tls: ServingCert | None = None
    password_file: Path | None = None

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    def client_env(self) -> dict[str, str]:
        """The `KVRAIL_*` settings of a client of this server."""
        env = {"KVRAIL_ETCD_ENDPOINTS": self.endpoint}
        if self.tls:
            env["KVRAIL_ETCD_CA_FILE"] = str(self.tls.ca_file)
        if self.password_file:
            env["KVRAIL_ETCD_USERNAME"] = ETCD_ROOT
            env["KVRAIL_ETCD_PASSWORD_FILE"] = str(self.password_file)
        return env

    def start(self, timeout_s: float = 30.0) -> EtcdServer:
        is_new = not (self.data_dir / "member").exists()
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
        if self.tls:
            argv += [f"--cert-file={self.tls.cert_file}", f"--key-file={self.tls.key_file}"]
        if _supports_flag(self.binary, "--unsafe-no-fsync"):
            argv.append("--unsafe-no-fsync")
        self.process = ManagedProcess("etcd", argv, self.log_path).start()
        context = ssl.create_default_context(cafile=str(self.tls.ca_file)) if self.tls else None
        self.process.wait_ready(
            lambda: http_ok(self.endpoint + "/health", context=context), timeout_s
        )
        if self.password_file and is_new:
            self._enable_auth(read_secret(self.password_file) or "", timeout_s)
        return self

    def _enable_auth(self, password: str, timeout_s: float) -> None:
        """User root (role root) with `password`, then authentication on, as the chart's Job
        does (`kvrail.etcd_auth`; Debian's etcd-server ships no etcdctl). Imported here: gRPC
        and aetcd are not installed everywhere this module runs (the GPU test machine imports
        it through the test harness)."""
        from kvrail.etcd_auth import channel, enable_auth

        with channel(self.endpoint, self.tls.ca_file if self.tls else None) as chan:
            enable_auth(chan, password, timeout_s)

    def stop(self) -> None:
        if self.process:
            self.process.stop()


@dataclass
class NatsServer:
    """A nats-server with JetStream on loopback; `monitor_port` serves /healthz (plain HTTP).
    TLS with `tls`; a user and password with `password_file` (the user is `user`)."""

    store_dir: Path
    log_path: Path
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    binary: str = field(default_factory=lambda: find_binary(*NATS_CANDIDATES))
    process: ManagedProcess | None = None
    tls: ServingCert | None = None
    user: str = "kvrail"
    password_file: Path | None = None

    @property
    def url(self) -> str:
        scheme = "tls" if self.tls else "nats"
        return f"{scheme}://127.0.0.1:{self.port}"

    def client_env(self) -> dict[str, str]:
        """The `KVRAIL_*` settings of a client of this server."""
        env = {"KVRAIL_NATS_URL": self.url}
        if self.tls:
            env["KVRAIL_NATS_CA_FILE"] = str(self.tls.ca_file)
        if self.password_file:
            env["KVRAIL_NATS_USER"] = self.user
            env["KVRAIL_NATS_PASSWORD_FILE"] = str(self.password_file)
        return env

    def start(self, timeout_s: float = 30.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / "nats.conf"
        config.write_text(self._config())
        env = None
        if self.password_file:
            # Read from the environment by the config file, never written to disk. nats-server
            # parses the variable as a config value: quoted, it is a string whatever it holds
            # (the quoting of the chart's NATS, kvrail.nats_auth).
            password = quoted(read_secret(self.password_file) or "")
            env = {**os.environ, "NATS_PASSWORD": password}
        argv = [
            self.binary,
            "-c", str(config),
            "-a", "127.0.0.1",
            "-p", str(self.port),
            "-m", str(self.monitor_port),
            "-js",
            "-sd", str(self.store_dir),
        ]  # fmt: skip
        self.process = ManagedProcess("nats", argv, self.log_path, env=env).start()
        health = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        self.process.wait_ready(lambda: http_ok(health), timeout_s)
        return self

    def _config(self) -> str:
        # max_payload has no flag: messages up to kvrail.codec.MAX_MESSAGE_BYTES (KV state
        # replies of large pools); the default is 1 MiB.
        lines = ["max_payload: 8MB"]
        if self.tls:
            lines += [
                "tls {",
                f"  cert_file: {json.dumps(str(self.tls.cert_file))}",
                f"  key_file: {json.dumps(str(self.tls.key_file))}",
                "}",
            ]
        if self.password_file:
            lines += [
                "authorization {",
                f"  user: {json.dumps(self.user)}",
                "  password: $NATS_PASSWORD",
                "}",
            ]
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        if self.process:
            self.process.stop()
