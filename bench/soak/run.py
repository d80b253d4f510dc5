"""Soak: kill -9 and restart each component under load, for a bounded time; report the figures.

    .venv/bin/python -P bench/soak/run.py --out bench/soak/            # ~5 scenarios x 60 s
    .venv/bin/python -P bench/soak/run.py --components nats,etcd --window-s 30

Real etcd, NATS (JetStream), `prefill-0`, `decode-0`, `decode-1` and one router, each its own
process (SmolLM2 on CPU); clients send greedy completions through the real `openai` client. Per
scenario: requests sent / completed (identical to the answer recorded before any fault) /
failed cleanly / lost (must be 0) / wrong (must be 0), the recovery time after the restart, and
the KV blocks still held once the load stopped (must be 0). See `testing/soak.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from kvrail.testing.soak import COMPONENTS, FAULTS, run_soak, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=",".join(COMPONENTS + FAULTS))
    parser.add_argument("--window-s", type=float, default=60.0, help="load per scenario")
    parser.add_argument("--fault-after-s", type=float, default=15.0)
    parser.add_argument("--down-s", type=float, default=5.0, help="how long it stays dead")
    parser.add_argument("--fault-s", type=float, default=15.0, help="how long a fault lasts")
    parser.add_argument("--deadline-s", type=float, default=20.0, help="per request")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write results.json and results.md here")
    parser.add_argument("--keep", type=Path, help="keep the logs in this directory")
    args = parser.parse_args()
    scenarios = tuple(c for c in args.scenarios.split(",") if c)
    unknown = set(scenarios) - set(COMPONENTS + FAULTS)
    if unknown:
        known = ", ".join(COMPONENTS + FAULTS)
        parser.error(f"unknown scenarios {sorted(unknown)} (known: {known})")
    root = args.keep or Path(tempfile.mkdtemp(prefix="kvrail-soak-"))
    started = time.monotonic()
    soak = run_soak(
        root, scenarios, window_s=args.window_s, fault_after_s=args.fault_after_s,
        down_s=args.down_s, fault_s=args.fault_s, deadline_s=args.deadline_s,
        num_clients=args.clients,
    )  # fmt: skip
    results, _answers = asyncio.run(soak)
    report = table(results)
    print(report)
    print(f"logs: {root}; {time.monotonic() - started:.0f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        setup = {
            "command": " ".join(sys.argv), "machine": platform.platform(),
            "python": platform.python_version(), "window_s": args.window_s,
            "fault_after_s": args.fault_after_s, "down_s": args.down_s, "fault_s": args.fault_s,
            "deadline_s": args.deadline_s, "clients": args.clients,
        }  # fmt: skip
        body = {"setup": setup, "scenarios": [r.as_dict() for r in results]}
        (args.out / "results.json").write_text(json.dumps(body, indent=2) + "\n")
        (args.out / "results.md").write_text(report + "\n")
    bad = [r for r in results if r.outcomes["lost"] or r.outcomes["wrong"] or r.blocks_leaked]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
