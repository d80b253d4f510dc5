"""The report: each request's JSON record, the machine, a plain-text table and the plots."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .stats import RequestResult


def request_record(r: RequestResult) -> dict[str, Any]:
    """One request in the JSON output (its chunk times are summarised, not listed)."""
    itl = r.gaps_s
    return {
        "index": r.index, "is_warmup": r.is_warmup, "start_s": r.start_s, "ttft_s": r.ttft_s,
        "e2e_s": r.e2e_s, "tpot_s": r.tpot_s, "itl_max_s": max(itl) if itl else None,
        "num_chunks": len(r.chunk_times_s), "output_tokens": r.output_tokens,
        "prompt_tokens": r.prompt_tokens, "approx_prompt_tokens": r.approx_prompt_tokens,
        "cached_tokens": r.cached_tokens, "prefix_id": r.prefix_id,
        "finish_reason": r.finish_reason, "error": r.error, "response_id": r.response_id,
    }  # fmt: skip


def _json_number(value: Any) -> Any:
    """JSON has no infinity: an infinite rate is written as the string "inf"."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def machine() -> dict[str, Any]:
    """Where the load generator ran (the server may be elsewhere)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "hostname": platform.node(), "python": platform.python_version(),
        "nproc": len(os.sched_getaffinity(0)), "cpu_model": model,
        "loadavg": list(os.getloadavg()),
    }  # fmt: skip


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(points: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of the load points' summaries (latencies in ms)."""
    head = (
        f"{'load':>18} {'done':>5} {'err':>4} {'req/s':>6} {'tok/s':>7} {'good/s':>6} "
        f"{'TTFT p50/p90/p99':>18} {'ITL p50/p90/p99':>16} {'TPOT p50/p99':>13}"
    )
    lines = [head]
    for p in points:
        s = p["summary"]

        def trio(d: dict[str, Any], keys: Sequence[str]) -> str:
            return "/".join(_ms(d[k]) for k in keys)

        lines.append(
            f"{p['label']:>18} {s['num_completed']:>5} {s['num_errors']:>4} "
            f"{s['requests_per_s'] or 0:>6.2f} {s['output_tokens_per_s'] or 0:>7.1f} "
            f"{s['goodput']['requests_per_s'] or 0:>6.2f} "
            f"{trio(s['ttft_s'], ('p50', 'p90', 'p99')):>18} "
            f"{trio(s['itl_s'], ('p50', 'p90', 'p99')):>16} "
            f"{trio(s['tpot_s'], ('p50', 'p99')):>13}"
        )
    return "\n".join(lines)


def plot(points: Sequence[dict[str, Any]], prefix: str) -> list[Path]:
    """`prefix`-latency.png and `prefix`-goodput.png, one x position per load point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(points)))
    labels = [p["label"].replace(" ", "\n", 1) for p in points]
    out = [Path(f"{prefix}-latency.png"), Path(f"{prefix}-goodput.png")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric, title in zip(axes, ("ttft_s", "itl_s", "tpot_s"), ("TTFT", "ITL", "TPOT"),
                                 strict=True):  # fmt: skip
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [p["summary"][metric][q] for p in points]
            ax.plot(x, [math.nan if y is None else y * 1000 for y in ys], style, label=q)
        ax.set(title=title, ylabel="ms", xticks=x)
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out[0], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, style, name in (("requests_per_s", "s--", "completed"), (None, "o-", "goodput")):
        ys = [p["summary"][key] if key else p["summary"]["goodput"]["requests_per_s"]
              for p in points]  # fmt: skip
        ax.plot(x, [math.nan if y is None else y for y in ys], style, label=name)
    rates = [p["point"]["rate"] for p in points]
    if all(isinstance(r, int | float) for r in rates):
        ax.plot(x, rates, "k:", label="offered")
    slo = points[0]["summary"]["goodput"]["slo"] if points else {}
    given = ", ".join(f"{k}={v}" for k, v in slo.items() if v is not None and k != "itl_stat")
    if slo.get("itl_s") is not None:
        given += f" (ITL: each request's {slo['itl_stat']})"
    ax.set(title=f"goodput (SLO: {given or 'none'})", ylabel="requests/s", xticks=x)
    ax.set_xticklabels(labels, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out[1], dpi=120)
    plt.close(fig)
    return out
