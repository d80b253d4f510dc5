"""Time to first token and where it went, per setup and rate, over several runs of
bench/sweep/run.py: the client's TTFT p50 and the workers' logged stages (p50 of each run), one
value per run and their median. For A/B runs of the same workload (`remote-cpu.sh`).

    .venv/bin/python -P bench/sweep/stages.py DIR/*.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

Key = tuple[str, str, float]  # setup, workload, offered rate


def collect(paths: list[Path]) -> dict[Key, dict[str, list[float]]]:
    """(setup, workload, offered rate) -> figure -> its p50 in each run, in ms. The workload is
    the point's sweep (`chat`, `long`)."""
    out: dict[Key, dict[str, list[float]]] = {}
    for path in paths:
        result: dict[str, Any] = json.loads(path.read_text())
        for setup in result["setups"]:
            for point in setup["points"]:
                workload = str(point["sweep"])
                key = (setup["setup"], workload, float(point["point"]["rate"]))
                figures = out.setdefault(key, {})
                figures.setdefault("TTFT", []).append(point["summary"]["ttft_s"]["p50"] * 1000)
                for stage, value in point["servers"]["stages_s"].items():
                    if stage != "cached_tokens":
                        figures.setdefault(stage, []).append(value["p50"] * 1000)
    return out


def markdown(table: dict[Key, dict[str, list[float]]]) -> str:
    lines = [
        "| setup | workload | rate | figure (p50, ms) | each run | median |",
        "|---|---|---:|---|---|---:|",
    ]
    for (setup, workload, rate), figures in sorted(table.items()):
        for name, values in figures.items():
            runs = ", ".join(f"{v:.1f}" for v in values)
            median = statistics.median(values)
            lines.append(f"| {setup} | {workload} | {rate:g} | {name} | {runs} | {median:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(collect([Path(p) for p in sys.argv[1:]])))
