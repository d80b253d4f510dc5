"""Goodput and completed requests/s against the offered rate: kvrail's setups and `vllm serve`.

    .venv/bin/python -P bench/sweep/plot_vs_vllm.py bench/sweep/chat600-h200-2026-12-02

Reads `kvrail.json` (bench/sweep/run.py's output, whose `vllm` setup, where it ran, is `vllm
serve` driven by the sweep's own client and judged by its rule) and any `vllm-chat-rate-*.json`
(`vllm bench serve --save-result`, as serve_chat.sh of the vLLM recipe writes them: its goodput
is by TPOT, and that script sends the same prompts at every rate, so only its first rate runs
with a cold prefix cache) from one folder, and draws `goodput.png` there. The burst (rate `inf`)
is drawn at twice the highest finite rate.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path[:0] = [str(Path(__file__).parent)]
import report  # noqa: E402


def main(folder: Path) -> None:
    series: dict[str, list[tuple[float, float, float]]] = {}  # name -> (rate, goodput, done)
    for r in report.rows(json.loads((folder / "kvrail.json").read_text()), "chat"):
        name = r["setup"] if r["setup"].startswith("vllm") else f"kvrail {r['setup']}"
        series.setdefault(name, []).append((r["rate"], r["goodput"], r["req_s"]))
    for path in sorted(folder.glob("vllm-chat-rate-*.json")):
        d = json.loads(path.read_text())
        rate = float(path.stem.removeprefix("vllm-chat-rate-"))
        series.setdefault("vllm bench serve (its client, TPOT rule)", []).append(
            (rate, d["request_goodput"], d["request_throughput"])
        )
    finite = [r for points in series.values() for r, _, _ in points if not math.isinf(r)]
    burst = 2 * max(finite)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    if len(series) > len(colors):
        raise SystemExit(f"{len(series)} series: at most {len(colors)} can be drawn apart")
    for (name, points), color in zip(series.items(), colors, strict=False):
        points.sort()
        x = [burst if math.isinf(r) else r for r, _, _ in points]
        ax.plot(x, [g for _, g, _ in points], "-o", color=color, label=f"{name}: goodput")
        ax.plot(x, [d for _, _, d in points], ":^", color=color, label=f"{name}: completed")
    ticks = sorted(set(finite)) + [burst]
    ax.plot(ticks[:-1], ticks[:-1], "k--", lw=0.8, label="offered")
    ax.set(xscale="log", xlabel="offered requests/s (Poisson; last: a burst of 160)",
           ylabel="requests/s", title="chat 600 in / 200 out, one H200: goodput "
           "(TTFT <= 2 s, ITL or TPOT <= 50 ms)")  # fmt: skip
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + ["burst"])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "goodput.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
