"""Tables and plots of bench/sweep/run.py's JSON; merges the JSONs of several runs into one.

    python3 -P bench/sweep/report.py colocated.json disaggregated.json \\
        --out bench/sweep/results-h200.json --plot bench/sweep/sweep-h200.png

prints a Markdown table per workload (one row per setup and rate) and, per setup and workload,
the highest offered rate whose TTFT p99 and ITL p99 (over all measured requests) meet the SLOs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STYLE = {
    "colocated": ("tab:blue", "o"),
    "disaggregated": ("tab:orange", "s"),
    "colocated-x2": ("tab:purple", "D"),
    "disaggregated-x2": ("tab:red", "v"),
}


def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result holding every run's setups (the first run's metadata, each run's own kept
    under `runs`)."""
    if len(results) == 1:
        return dict(results[0])
    merged = {k: v for k, v in results[0].items() if k != "setups"}
    merged["runs"] = [{k: v for k, v in r.items() if k != "setups"} for r in results]
    merged["setups"] = [s for r in results for s in r["setups"]]
    return merged


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def meets(summary: dict[str, Any]) -> bool:
    """The point's TTFT p99 and ITL p99 (over every measured request) are within its SLOs, and
    every measured request completed."""
    slo = summary["goodput"]["slo"]
    ttft, itl = summary["ttft_s"]["p99"], summary["itl_s"]["p99"]
    return (
        summary["num_errors"] == 0 and ttft is not None and itl is not None
        and (slo["ttft_s"] is None or ttft <= slo["ttft_s"])
        and (slo["itl_s"] is None or itl <= slo["itl_s"])
    )  # fmt: skip


def goodput_by_tpot(point: dict[str, Any]) -> float | None:
    """Requests/s that completed with TTFT within its SLO and a TPOT (their mean gap) within the
    ITL SLO: `vllm bench serve --goodput ttft:2000 tpot:50`'s rule, laxer than the sweep's own
    (the request's own ITL p99), for figures beside vLLM's own benchmark's."""
    s = point["summary"]
    slo, window = s["goodput"]["slo"], s["window_s"]
    if not window:
        return None
    good = sum(
        1 for r in point["requests"]
        if not r["is_warmup"] and r["error"] is None
        and (slo["ttft_s"] is None or r["ttft_s"] <= slo["ttft_s"])
        and (slo["itl_s"] is None or r["tpot_s"] is None or r["tpot_s"] <= slo["itl_s"])
    )  # fmt: skip
    return good / window


def rows(result: dict[str, Any], sweep: str) -> list[dict[str, Any]]:
    """One row per (setup, point) of `sweep`, in setup then rate order."""
    out = []
    for setup in result["setups"]:
        for p in setup["points"]:
            if p["sweep"] != sweep:
                continue
            s = p["summary"]
            out.append({
                "setup": setup["setup"], "rate": float(p["point"]["rate"]),  # "inf": a burst
                "arrival": s["arrival_rate_per_s"], "done": s["num_completed"],
                "errors": s["num_errors"], "req_s": s["requests_per_s"],
                "tok_s": s["output_tokens_per_s"], "ttft": s["ttft_s"], "itl": s["itl_s"],
                "tpot": s["tpot_s"], "goodput": s["goodput"]["requests_per_s"],
                "attainment": s["goodput"]["attainment"], "meets": meets(s),
                "goodput_tpot": goodput_by_tpot(p),
                "client": p.get("client"),  # older runs did not record it
                "modes": p.get("servers", {}).get("prefill_modes", {}),
            })  # fmt: skip
    return sorted(out, key=lambda r: (r["setup"], r["rate"]))


def table(result: dict[str, Any], sweep: str) -> str:
    head = ("| setup | offered req/s (measured) | done / err | req/s | output tok/s "
            "| TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 (ms) "
            "| goodput req/s (attainment) | by TPOT | p99s in SLO |"
            "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|")  # fmt: skip
    lines = [head]
    for r in rows(result, sweep):
        arrival = f"{r['arrival']:.2f}" if r["arrival"] else "-"
        attain = f"{100 * r['attainment']:.0f}%" if r["attainment"] is not None else "-"
        lines.append(
            f"| {r['setup']} | {r['rate']:g} ({arrival}) | {r['done']} / {r['errors']} | "
            f"{_s(r['req_s'])} | {r['tok_s'] or 0:,.0f} | {_ms(r['ttft']['p50'])} / "
            f"{_ms(r['ttft']['p99'])} | {r['itl']['p50'] * 1000 if r['itl']['p50'] else 0:.1f} / "
            f"{r['itl']['p99'] * 1000 if r['itl']['p99'] else 0:.1f} | "
            f"{r['tpot']['p50'] * 1000 if r['tpot']['p50'] else 0:.1f} | "
            f"{_s(r['goodput'])} ({attain}) | {_s(r['goodput_tpot'])} | "
            f"{'yes' if r['meets'] else 'no'} |"
        )
    return "\n".join(lines)


def best_rates(result: dict[str, Any], sweep: str) -> dict[str, float | None]:
    """Per setup, the highest offered rate whose p99s are within the SLOs."""
    best: dict[str, float | None] = {}
    for r in rows(result, sweep):
        best.setdefault(r["setup"], None)
        if r["meets"]:
            best[r["setup"]] = max(r["rate"], best[r["setup"]] or 0.0)
    return best


def sweeps_of(result: dict[str, Any]) -> list[str]:
    names = {p["sweep"] for s in result["setups"] for p in s["points"]}
    return [n for n in ("long", "chat") if n in names]


def markdown(result: dict[str, Any]) -> str:
    parts = []
    for sweep in sweeps_of(result):
        parts.append(f"### {sweep}\n\n{table(result, sweep)}\n")
        best = ", ".join(f"{k}: {v:g} req/s" if v is not None else f"{k}: none of the rates"
                         for k, v in best_rates(result, sweep).items())  # fmt: skip
        parts.append(f"Highest offered rate with TTFT p99 and ITL p99 within the SLOs: {best}.\n")
        bound = [r for r in rows(result, sweep) if r["client"] and r["client"]["bound"]]
        parts += [f"- client-bound: {r['setup']} at {r['rate']:g} req/s (its busiest load "
                  f"generator process {r['client']['busiest_cpu_fraction']:.0%} busy: the gaps "
                  "are partly the client's)" for r in bound]  # fmt: skip
        parts += [""] if bound else []
    for setup in result["setups"]:
        for skipped in setup.get("skipped", []):
            parts.append(f"- skipped: {setup['setup']} {skipped['sweep']} at {skipped['rate']:g}"
                         f"/s ({skipped['reason']})")  # fmt: skip
    return "\n".join(parts)


def plot(result: dict[str, Any], path: Path) -> None:
    """One row per workload: TTFT p50/p99, ITL p50/p99 and goodput against the offered rate,
    one line per setup, the SLOs dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    sweeps = sweeps_of(result)
    fig, axes = plt.subplots(len(sweeps), 3, figsize=(15, 4.2 * len(sweeps)), squeeze=False)
    slo = result["config"]
    for ax_row, sweep in zip(axes, sweeps, strict=True):
        data = rows(result, sweep)
        for setup in dict.fromkeys(r["setup"] for r in data):
            mine = [r for r in data if r["setup"] == setup]
            color, marker = STYLE.get(setup, ("tab:green", "^"))
            x = [r["rate"] for r in mine]
            for ax, key in ((ax_row[0], "ttft"), (ax_row[1], "itl")):
                scale = 1.0 if key == "ttft" else 1000.0
                for q, style in (("p99", "-"), ("p50", ":")):
                    y = [r[key][q] * scale if r[key][q] is not None else math.nan for r in mine]
                    ax.plot(x, y, style, color=color, marker=marker, label=f"{setup} {q}")
            good = [r["goodput"] if r["goodput"] is not None else math.nan for r in mine]
            ax_row[2].plot(x, good, "-", color=color, marker=marker, label=f"{setup} goodput")
            done = [r["req_s"] if r["req_s"] is not None else math.nan for r in mine]
            ax_row[2].plot(x, done, ":", color=color, marker=marker, label=f"{setup} completed")
        rates = sorted({r["rate"] for r in data})
        ax_row[2].plot(rates, rates, "k--", lw=0.8, label="offered")
        ax_row[0].axhline(slo["slo_ttft_s"], color="r", ls="--", lw=0.8, label="SLO")
        ax_row[1].axhline(slo["slo_itl_s"] * 1000, color="r", ls="--", lw=0.8, label="SLO")
        titles = (f"{sweep}: TTFT (s)", f"{sweep}: ITL (ms)",
                  f"{sweep}: goodput (TTFT<={slo['slo_ttft_s']:g}s, own ITL p99<="
                  f"{slo['slo_itl_s'] * 1000:g}ms)")  # fmt: skip
        for ax, title in zip(ax_row, titles, strict=True):
            ax.set(title=title, xlabel="offered requests/s (Poisson)", xscale="log")
            ax.set_xticks(rates, [f"{r:g}" for r in rates])
            ax.xaxis.set_minor_locator(ticker.NullLocator())
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        for ax in ax_row[:2]:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax_row[2].set_ylabel("requests/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("inputs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, help="write the merged JSON here")
    p.add_argument("--plot", type=Path, help="PNG")
    args = p.parse_args(argv)
    result = merge([json.loads(path.read_text()) for path in args.inputs])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
