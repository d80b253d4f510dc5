"""ManagedProcess: a log per start, and no child outliving what started it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kvrail.local.procs import ManagedProcess, free_port, port_in_use


def test_log_text_is_this_starts_output_only(tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    for word in ("first", "second"):
        proc = ManagedProcess("echo", ["sh", "-c", f"echo {word}"], log).start()
        deadline = time.monotonic() + 10
        while proc.returncode() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert log.read_text().split() == ["first", "second"]
    assert proc.log_text().split() == ["second"]  # readiness never reads an earlier run


def test_a_child_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """The parent is killed with SIGKILL (no cleanup of its own): its child goes too."""
    code = (
        "import sys, time; from pathlib import Path; from kvrail.local.procs import ManagedProcess;"
        f"p = ManagedProcess('sleeper', ['sleep', '300'], Path({str(tmp_path / 's.log')!r}));"
        "p.start(); print(p.pid, flush=True); time.sleep(300)"
    )
    parent = subprocess.Popen([sys.executable, "-P", "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.kill()
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (
        Path(f"/proc/{child}").exists() and b"sleep" in Path(f"/proc/{child}/cmdline").read_bytes()
    ):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)


def test_port_in_use_tells_a_taken_port_from_a_free_one() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert port_in_use("127.0.0.1", s.getsockname()[1])
    assert not port_in_use("127.0.0.1", free_port())


def test_free_port_lies_below_the_kernels_ephemeral_range_and_skips_taken_ports() -> None:
    """The kernel never gives these ports to a bind to port 0 or an outgoing connection."""
    import socket

    from kvrail.local import procs

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port < low for port in ports)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", procs._port_next))
        assert free_port() != taken.getsockname()[1]
