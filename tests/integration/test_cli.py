"""The `kvrail` command: `kvrail up` (what `make run` starts) serves for real, and the rest."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvrail.bus import PrefillQueue, connect
from kvrail.keys import PoolKeys
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import WorkerRecord
from kvrail.registry import etcd_client
from kvrail.settings import Settings

KVRAIL = [sys.executable, "-P", "-c", "import sys; from kvrail.cli import main; sys.exit(main())"]


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
    assert "pool default/status-test: 1 decode; 1 queued jobs" in out.stdout
    assert out.stdout.splitlines()[2].split() == [
        "decode-0", "decode", "3", "yes", "nixl-ucx", "2", "0", "50%"]  # fmt: skip


def test_status_reports_an_unreachable_etcd_clearly(nats_server: NatsServer) -> None:
    env = {**os.environ, "KVRAIL_ETCD_ENDPOINTS": "http://127.0.0.1:1",
           "KVRAIL_NATS_URL": nats_server.url}  # fmt: skip
    out = subprocess.run([*KVRAIL, "status"], capture_output=True, text=True, timeout=90,
                         env=env)  # fmt: skip
    assert out.returncode == 2
    assert "cannot read etcd at http://127.0.0.1:1" in out.stderr
    assert "Traceback" not in out.stderr
