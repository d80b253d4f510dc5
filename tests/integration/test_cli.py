"""`kvrail up` (what `make run` starts) runs the real servers and says what is not built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KVRAIL = [sys.executable, "-P", "-c", "import sys; from kvrail.cli import main; sys.exit(main())"]


@pytest.mark.usefixtures("etcd_server")  # fails early, with a clear message, if etcd is missing
def test_up_starts_etcd_and_nats_reports_missing_pieces_and_stops(tmp_path: Path) -> None:
    out = subprocess.run([*KVRAIL, "up", "--check", "--run-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert "etcd                 running  http://127.0.0.1:" in out.stdout
    assert "NATS (JetStream)     running  nats://127.0.0.1:" in out.stdout
    assert "stopped etcd and NATS" in out.stdout
    # No server outlives the command.
    for name in ("etcd", "nats-server"):
        ps = subprocess.run(["pgrep", "-f", f"{name}.*{tmp_path}"], capture_output=True)
        assert ps.returncode == 1, f"{name} still running: {ps.stdout!r}"


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
