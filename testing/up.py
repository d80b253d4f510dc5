"""`kvrail up` (what `make run` starts) for tests that drive the whole local stack the way a user
does, with a real client (lm-eval, the OpenAI SDK, LangChain, the OpenAI Agents SDK).

`kvrail_up` starts it in its own run directory, waits for the line that says it serves, yields
the server's root URL, and stops it however the test ends: SIGINT (it stops what it started),
then, if that does not end it within `STOP_TIMEOUT_S`, a kill, so it never outlives the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from kvrail.local.procs import free_port

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120.0
KVRAIL = [sys.executable, "-P", "-m", "kvrail.cli"]


@contextmanager
def kvrail_up(run_dir: Path, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """`kvrail up --run-dir run_dir` on a free port with one torch thread per process and the
    settings in `env` (`KVRAIL_*` variables) over the process's environment; its output goes to
    `run_dir / "up.log"`. Yields `http://127.0.0.1:<port>` (the OpenAI API is under `/v1`)."""
    port = free_port()
    full = {**os.environ, "KVRAIL_HTTP_PORT": str(port), "KVRAIL_POOL": f"up-{port}",
            "KVRAIL_TORCH_NUM_THREADS": "1", **(env or {})}  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "up.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*KVRAIL, "up", "--run-dir", str(run_dir)], env=full,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "press Ctrl-C" not in log.read_text():
            if proc.poll() is not None:
                raise RuntimeError(f"kvrail up exited:\n{log.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvrail up not serving in time:\n{log.read_text()}")
            time.sleep(0.5)
        root = f"http://127.0.0.1:{port}"
        if f"{root}/v1" not in log.read_text():
            raise RuntimeError(f"kvrail up does not say it serves {root}/v1:\n{log.read_text()}")
        yield root
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
