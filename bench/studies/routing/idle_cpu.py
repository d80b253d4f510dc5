"""CPU an idle worker uses, with NIXL's progress thread on (as kvrail ships) and off (the shim).

    .venv/bin/python -P bench/studies/routing/idle_cpu.py   # ~1 min, writes idle_cpu.json

Starts real etcd and NATS, then one colocated `--role colocated` worker at a time (no router, no
requests), waits until it is ready and a few seconds more, and measures over `--seconds` the CPU
time of the whole process and of its busiest thread (/proc/<pid>/task/*/stat). With the thread
on, the busiest thread is NIXL's UCX progress thread (`nixlUcxSharedThread::run`, identified with
`gdb -p <pid> -batch -ex "thread apply all bt"`: it loops in `poll()` with a zero timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool

SHIM = Path(__file__).resolve().parents[2] / "routing" / "no_nixl_progress_thread"


def thread_ticks(pid: int) -> dict[int, int]:
    """user + system clock ticks of every thread of `pid`."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = int(fields[11]) + int(fields[12])
    return out


def measure(pid: int, seconds: float) -> dict[str, float]:
    before = thread_ticks(pid)
    time.sleep(seconds)
    after = thread_ticks(pid)
    ticks = seconds * os.sysconf("SC_CLK_TCK")
    per_thread = [(v - before.get(t, 0)) / ticks for t, v in after.items()]
    return {
        "process_cores": round(sum(per_thread), 3),
        "busiest_thread_cores": round(max(per_thread), 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "idle_cpu.json")
    p.add_argument("--seconds", type=float, default=15.0)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvrail-bench-idle-"))
    etcd = EtcdServer(root / "etcd", root / "etcd.log").start()
    nats = NatsServer(root / "js", root / "nats.log").start()
    results = {}
    try:
        for thread in ("on", "off"):
            env = {"KVRAIL_DISAGGREGATION_MODE": "colocated", "KVRAIL_TORCH_NUM_THREADS": "1"}
            if thread == "off":
                env["PYTHONPATH"] = os.pathsep.join(
                    filter(None, [str(SHIM), os.environ.get("PYTHONPATH")])
                )
            pool = LocalPool(etcd, nats, root / thread, f"idle-{uuid.uuid4().hex[:6]}", env)
            try:
                pool.start("decode-0", "colocated")
                pool.wait_ready("decode-0")
                time.sleep(3)
                pid = pool.procs["decode-0"].pid
                assert pid is not None
                results[thread] = {**measure(pid, args.seconds), "loadavg": os.getloadavg()[0]}
                print(f"progress thread {thread}: {results[thread]}", file=sys.stderr)
            finally:
                pool.stop()
    finally:
        nats.stop()
        etcd.stop()
    report = {
        "command": "python -P bench/studies/routing/idle_cpu.py " + " ".join(sys.argv[1:]),
        "measured_unix_s": time.time(), "seconds": args.seconds, "nixl_progress_thread": results,
    }  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
