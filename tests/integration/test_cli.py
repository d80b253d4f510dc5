"""The `kvrail` command: `kvrail up` (what `make run` starts) serves for real, and the rest."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvrail.bus import PrefillQueue, connect
from kvrail.keys import PoolKeys
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import KvTierUsage, WorkerRecord
from kvrail.registry import etcd_client
from kvrail.settings import Settings

KVRAIL = [sys.executable, "-P", "-m", "kvrail.cli"]


@pytest.mark.usefixtures("etcd_server")  # fails early, with a clear message, if etcd is missing
def test_up_serves_the_model_and_the_printed_curl_returns_generated_text(tmp_path: Path) -> None:
    """What the README promises: `make run` (= `kvrail up`), then the curl it prints."""
    port = free_port()
    pool = f"up-{port}"  # to tell this stack's processes from other tests'
    env = {**os.environ, "KVRAIL_HTTP_PORT": str(port), "KVRAIL_TORCH_NUM_THREADS": "1",
           "KVRAIL_POOL": pool}  # fmt: skip
    proc = subprocess.Popen([*KVRAIL, "up", "--run-dir", str(tmp_path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "press Ctrl-C" in line or proc.poll() is not None:
                break
        out = "".join(lines)
        assert "press Ctrl-C" in out, out
        for expected in ("etcd                 running", "NATS (JetStream)     running",
                         "prefill worker       running  prefill-0",
                         "decode worker        running  decode-0",
                         f"router (OpenAI API)  running  http://127.0.0.1:{port}/v1"):  # fmt: skip
            assert expected in out
        curl = out[out.index("  curl ") : out.index("press Ctrl-C")].rsplit("kvrail up:", 1)[0]
        reply = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        body = json.loads(reply.stdout)
        text = body["choices"][0]["message"]["content"]
        assert body["object"] == "chat.completion" and text.strip(), body
        assert body["usage"]["completion_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    assert "stopped everything it started" in rest
    # No process outlives the command: none runs from its run dir or with its pool.
    for name in ("etcd", "nats-server"):
        ps = subprocess.run(["pgrep", "-f", f"{name}.*{tmp_path}"], capture_output=True)
        assert ps.returncode == 1, f"{name} still running: {ps.stdout!r}"
    ps = subprocess.run(["pgrep", "-f", "kvrail[.](worker|router)"], capture_output=True, text=True)
    left = [pid for pid in ps.stdout.split() if f"KVRAIL_POOL={pool}".encode() in _environ(pid)]
    assert not left, f"kvrail processes of this stack still running: {left}"


def _environ(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def test_invalid_settings_exit_with_a_clear_message() -> None:
    out = subprocess.run([*KVRAIL, "config"], capture_output=True, text=True, timeout=60,
                         env={"KVRAIL_BLOCK_SIZE": "-1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 2
    assert "block_size" in out.stderr and "Traceback" not in out.stderr


def test_model_prepare_prints_the_cached_conversion_of_the_default_model() -> None:
    out = subprocess.run([*KVRAIL, "model", "prepare"], capture_output=True, text=True,
                         timeout=600, check=True)  # fmt: skip
    prepared = Path(out.stdout.strip().splitlines()[-1])
    assert (prepared / "config.json").is_file()
    assert list(prepared.glob("*.safetensors"))


def test_status_shows_registered_workers_and_the_prefill_backlog(
    etcd_server: EtcdServer, nats_server: NatsServer
) -> None:
    keys = PoolKeys("default", "status-test")

    async def populate() -> None:
        async with etcd_client(Settings(etcd_endpoints=(etcd_server.endpoint,))) as etcd:
            record = WorkerRecord(worker_id="decode-0", pod_uid="u", incarnation=3, role="decode",
                                  fingerprint="f", is_ready=True, transport="nixl-ucx",
                                  num_running=2, kv_utilization=0.5)  # fmt: skip
            await etcd.put(keys.worker("decode-0").encode(), record.encode())
            host = KvTierUsage("host", used_bytes=3 << 30, capacity_bytes=4 << 30,
                               num_blocks=96, num_hit_blocks=1200, num_loads=40)  # fmt: skip
            tiered = WorkerRecord(worker_id="decode-1", pod_uid="v", incarnation=1,
                                  role="decode", fingerprint="f", kv_tiers=(host,))  # fmt: skip
            await etcd.put(keys.worker("decode-1").encode(), tiered.encode())
        nc = await connect(Settings(nats_url=nats_server.url), name="test")
        queue = PrefillQueue(nc.jetstream(), keys)
        await queue.ensure_stream()
        await nc.jetstream().publish(keys.prefill_any, b"{}")
        await nc.close()

    asyncio.run(populate())
    env = {**os.environ, "KVRAIL_ETCD_ENDPOINTS": etcd_server.endpoint,
           "KVRAIL_NATS_URL": nats_server.url, "KVRAIL_POOL": "status-test"}  # fmt: skip
    out = subprocess.run([*KVRAIL, "status"], capture_output=True, text=True, timeout=60,
                         env=env, check=True)  # fmt: skip
    assert "pool default/status-test: 2 decode; 1 queued jobs" in out.stdout
    lines = out.stdout.splitlines()
    assert lines[2].split() == [
        "decode-0", "decode", "3", "yes", "nixl-ucx", "2", "0", "50%"]  # fmt: skip
    assert lines[3].split()[0] == "decode-1"
    assert lines[4] == "    host 3.0 GiB of 4.0 GiB (75%), 96 blocks, 1200 hit blocks, 40 loads"


def test_status_reports_an_unreachable_etcd_clearly(nats_server: NatsServer) -> None:
    env = {**os.environ, "KVRAIL_ETCD_ENDPOINTS": "http://127.0.0.1:1",
           "KVRAIL_NATS_URL": nats_server.url}  # fmt: skip
    out = subprocess.run([*KVRAIL, "status"], capture_output=True, text=True, timeout=90,
                         env=env)  # fmt: skip
    assert out.returncode == 2
    assert "cannot read etcd at http://127.0.0.1:1" in out.stderr
    assert "Traceback" not in out.stderr


def test_status_reports_an_unreachable_nats_in_one_line_at_once(etcd_server: EtcdServer) -> None:
    env = {**os.environ, "KVRAIL_ETCD_ENDPOINTS": etcd_server.endpoint,
           "KVRAIL_NATS_URL": f"nats://127.0.0.1:{free_port()}"}  # fmt: skip
    started = time.monotonic()
    out = subprocess.run([*KVRAIL, "status"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and time.monotonic() - started < 15
    (line,) = [line for line in out.stderr.splitlines() if line.strip()]
    assert line.startswith("kvrail: error: cannot reach NATS at nats://127.0.0.1:")
    assert not line.endswith(": ")  # a reason follows the colon


# `kvrail up` supervising its stack, as a user sees it. A cache dir of its own (so `kvrail status`
# finds this stack's run dir), with the converted model and tokenizer linked from the real one.


def _cache_dir(tmp_path: Path) -> Path:
    real = Path(os.environ.get("KVRAIL_CACHE_DIR") or Path.home() / ".cache/kvrail")
    subprocess.run([*KVRAIL, "model", "prepare"], check=True, capture_output=True, timeout=900)
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("models", "tokenizers"):
        if (real / name).exists():
            (cache / name).symlink_to(real / name)
    return cache


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Up:
    """`kvrail up` started with SIGINT ignored (as a background job of a non-interactive shell
    starts), its output read by a thread."""

    def __init__(self, cache: Path, port: int, pool: str) -> None:
        self.env = {**os.environ, "KVRAIL_HTTP_PORT": str(port), "KVRAIL_CACHE_DIR": str(cache),
                    "KVRAIL_TORCH_NUM_THREADS": "1", "KVRAIL_POOL": pool}  # fmt: skip
        self.port, self.pool = port, pool
        self.proc = subprocess.Popen(
            [*KVRAIL, "up"], env=self.env, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, preexec_fn=_ignore_sigint,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None or any(text in ln for ln in self.lines), self.output
            assert time.monotonic() < deadline, f"no {text!r} within {timeout_s} s\n{self.output}"
            time.sleep(0.2)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def chat(self) -> dict[str, object]:
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hi"}]}).encode()  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as reply:
            result: dict[str, object] = json.loads(reply.read())
            return result

    def pids(self) -> list[int]:
        """Every process of this stack (its environment names the stack's pool)."""
        ps = subprocess.run(["pgrep", "-f", "kvrail|etcd|nats-server"], capture_output=True,
                            text=True)  # fmt: skip
        mine = f"KVRAIL_POOL={self.pool}".encode()
        own = {os.getpid()}
        return [int(p) for p in ps.stdout.split() if int(p) not in own and mine in _environ(p)]


def _worker_pid(up: _Up, worker_id: str) -> int:
    for pid in up.pids():
        if f"--worker-id\0{worker_id}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no process for {worker_id}")


def test_up_restarts_what_dies_is_found_by_status_and_stops_on_sigint_ignored_or_not(
    tmp_path: Path,
) -> None:
    cache = _cache_dir(tmp_path)
    port = free_port()
    up = _Up(cache, port, f"up-{port}")
    try:
        up.wait_for("press Ctrl-C", 300)
        assert up.chat()["object"] == "chat.completion"
        # `kvrail status` with no planes named finds the stack (and says its KV in blocks).
        status_env = {k: v for k, v in os.environ.items() if not k.startswith("KVRAIL_")}
        status_env["KVRAIL_CACHE_DIR"] = str(cache)
        out = subprocess.run([*KVRAIL, "status"], capture_output=True, text=True, timeout=60,
                             env=status_env, check=True).stdout  # fmt: skip
        assert f"pool default/{up.pool}:" in out and "decode-0" in out and "blocks)" in out, out
        shown = subprocess.run([*KVRAIL, "config"], capture_output=True, text=True, timeout=60,
                               env=status_env, check=True)  # fmt: skip
        config = json.loads(shown.stdout)
        assert config["pool"] == up.pool and config["nats_url"] != "nats://127.0.0.1:4222"
        # A killed worker comes back, and the stack serves again.
        os.kill(_worker_pid(up, "decode-0"), signal.SIGKILL)
        up.wait_for("the decode worker exited", 30)
        up.wait_for("the decode worker restarted", 30)
        deadline = time.monotonic() + 180
        while True:
            try:
                assert up.chat()["object"] == "chat.completion"
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, up.output
                time.sleep(1)
    finally:
        up.proc.send_signal(signal.SIGINT)  # ignored by its parent shell, not by `kvrail up`
        started = time.monotonic()
        up.proc.wait(timeout=60)
    assert time.monotonic() - started < 30, "the stack did not stop within its grace"
    up._reader.join(timeout=5)
    assert "stopped everything it started" in up.output
    assert not up.pids()


def test_a_killed_up_takes_every_process_it_started_with_it(tmp_path: Path) -> None:
    cache = _cache_dir(tmp_path)
    port = free_port()
    up = _Up(cache, port, f"up-{port}")
    try:
        up.wait_for("press Ctrl-C", 300)
        assert len(up.pids()) >= 6  # etcd, NATS, two workers, router, and `kvrail up` itself
    finally:
        up.proc.kill()
        up.proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while up.pids():
        assert time.monotonic() < deadline, f"left running: {up.pids()}"
        time.sleep(0.2)


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "KVRAIL_HTTP_PORT": str(port)}
        started = time.monotonic()
        out = subprocess.run([*KVRAIL, "up", "--run-dir", str(tmp_path)], capture_output=True,
                             text=True, timeout=60, env=env)  # fmt: skip
    assert out.returncode == 2 and time.monotonic() - started < 10
    assert f"port {port} on 127.0.0.1 is in use" in out.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started
