"""Tables and the plot of the routing experiment, from its results.json (written by run.py).

    .venv/bin/python -P bench/routing/report.py bench/routing/results.json [more.json ...]
        [--plot ttft.png]

Prints two Markdown tables: latency and throughput per rate and policy, then where the requests
went and what that cost (cache hits, blocks computed, prefix moves); with more files (repeats of
the same command), a third table puts their key figures side by side. Every figure is computed
here from the JSON files, so the README's tables can be regenerated from the committed ones.

Definitions beyond the load generator's (see bench/loadgen/):
- rate: the nominal Poisson rate, and in brackets the rate the measured requests really arrived
  at ((n - 1) / span of their send times).
- TTFT p50 interval: a 95% bootstrap interval (2,000 resamples of the measured requests, seeded).
- router cache hits: `kvrail_routing_decisions_total{cache="hit"}` over all decisions of the
  point (warm-up included): the chosen worker held at least one leading block of the prompt.
- blocks computed: blocks the two workers stored in their prefix caches (their KV events) during
  the point, i.e. full prompt blocks they had to prefill.
- slow prefills: requests whose worker took more than 0.7 s from submit to first token; with a
  400-token prefix a cache hit takes about 0.2 s on this machine and a miss about 1.0-1.3 s.
- TTFT by cache and load: every completed request of the file (warm-up included), grouped by
  whether its system prompt had been served on its worker before (then probably still cached)
  and by how many requests were in flight on that worker when it arrived.
- prefix moves: a request served by another worker than the previous request with the same
  system prompt; "busier" counts the moves made while that previous worker had more requests in
  flight than the chosen one (from the client's view: requests sent and not yet finished).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SLOW_PREFILL_S = 0.7


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default), like bench/loadgen/."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def bootstrap_interval(
    values: Sequence[float], q: float, *, num_resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the q-th percentile of `values`."""
    if not values:
        raise ValueError("no values")
    rng = random.Random(seed)
    stats = sorted(percentile(rng.choices(values, k=len(values)), q) for _ in range(num_resamples))
    return percentile(stats, 2.5), percentile(stats, 97.5)


def prefix_affinity(requests: Sequence[dict[str, Any]]) -> float | None:
    """The share of requests served by the worker that served most requests of their prefix
    (1.0: every prefix stuck to one worker; about 0.5 with two workers and no stickiness)."""
    by_prefix: dict[int, Counter[str]] = defaultdict(Counter)
    for r in requests:
        if r.get("worker") is not None and r["prefix_id"] is not None:
            by_prefix[r["prefix_id"]][r["worker"]] += 1
    total = sum(sum(c.values()) for c in by_prefix.values())
    return sum(max(c.values()) for c in by_prefix.values()) / total if total else None


def prefix_moves(requests: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How often a request left the worker that served its prefix last (see the docstring).
    `requests` carry `start_s`, `e2e_s`, `prefix_id` and `worker`; warm-up ones included, since
    they fill caches too."""
    ordered = sorted((r for r in requests if r.get("worker")), key=lambda r: r["start_s"])
    last: dict[int, str] = {}
    out = {"stayed": 0, "moved": 0, "moved_busier": 0}
    for r in ordered:
        previous = last.get(r["prefix_id"])
        last[r["prefix_id"]] = r["worker"]
        if previous is None:
            continue
        if previous == r["worker"]:
            out["stayed"] += 1
            continue
        out["moved"] += 1
        t = r["start_s"]
        if in_flight(ordered, previous, t) > in_flight(ordered, r["worker"], t):
            out["moved_busier"] += 1
    return out


def in_flight(requests: Sequence[dict[str, Any]], worker: str, t: float) -> int:
    """Requests on `worker` sent before `t` and not finished at `t` (the client's view)."""
    return sum(
        1 for o in requests
        if o.get("worker") == worker and o["start_s"] < t <= o["start_s"] + o["e2e_s"]
    )  # fmt: skip


def ttft_by_cache_and_load(runs: Sequence[dict[str, Any]]) -> dict[tuple[bool, int], list[float]]:
    """TTFT of every completed request (all points, warm-up included) keyed by (its system prompt
    was served on its worker before, requests in flight on that worker when it arrived, 2 = 2 or
    more): what a prefix hit is worth against a busier worker."""
    out: dict[tuple[bool, int], list[float]] = defaultdict(list)
    for run in runs:
        for point in run["points"]:
            done = [r for r in point["requests"] if r.get("worker") and r["ttft_s"] is not None]
            for r in done:
                seen = any(
                    o["worker"] == r["worker"] and o["prefix_id"] == r["prefix_id"]
                    and o["start_s"] < r["start_s"] for o in done
                )  # fmt: skip
                load = min(in_flight(done, r["worker"], r["start_s"]), 2)
                out[(seen, load)].append(r["ttft_s"])
    return dict(out)


def cache_and_load_table(runs: Sequence[dict[str, Any]]) -> str:
    groups = ttft_by_cache_and_load(runs)
    lines = [
        "| system prompt served on this worker before | requests in flight there at arrival "
        "| requests | TTFT p50 (s) |",
        "|---|---|---|---|",
    ]
    for seen in (True, False):
        for load in (0, 1, 2):
            values = groups.get((seen, load), [])
            if values:
                lines.append(
                    f"| {'yes' if seen else 'no'} | {load if load < 2 else '2 or more'} | "
                    f"{len(values)} | {percentile(values, 50):.2f} |"
                )
    return "\n".join(lines)


def point_rows(point: dict[str, Any]) -> dict[str, Any]:
    """The figures of one (policy, rate) point that the tables show."""
    s, srv = point["summary"], point["servers"]
    measured = [r for r in point["requests"] if not r["is_warmup"] and r["error"] is None]
    ttfts = [r["ttft_s"] for r in measured]
    hits = srv["router"].get("decisions_hit", 0)
    prefills = [r["worker_prefill_s"] for r in measured if r.get("worker_prefill_s") is not None]
    starts = sorted(r["start_s"] for r in point["requests"] if not r["is_warmup"])
    return {
        "arrival_rate": (len(starts) - 1) / (starts[-1] - starts[0]),
        "ttft": s["ttft_s"], "ttft_p50_ci": bootstrap_interval(ttfts, 50), "itl": s["itl_s"],
        "tpot": s["tpot_s"], "requests_per_s": s["requests_per_s"],
        "output_tokens_per_s": s["output_tokens_per_s"],
        "goodput": s["goodput"]["requests_per_s"], "attainment": s["goodput"]["attainment"],
        "hits": hits, "decisions": hits + srv["router"].get("decisions_miss", 0),
        "blocks_computed": sum(srv["kv"]["blocks_stored"].values()),
        "slow_prefills": sum(p > SLOW_PREFILL_S for p in prefills), "num_measured": len(measured),
        "affinity": prefix_affinity(measured), "moves": prefix_moves(point["requests"]),
        "served": srv["served"], "external_cores": point["machine_load"]["external_cores_median"],
    }  # fmt: skip


def tables(runs: Sequence[dict[str, Any]]) -> str:
    latency = [
        "| rate (req/s): nominal (real) | policy | TTFT p50 [95% CI] (s) | TTFT p90 / p99 (s) "
        "| ITL p50 / p99 (ms) | TPOT p50 (ms) | completed req/s | output tok/s "
        "| goodput req/s (attainment) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    routing = [
        "| rate (req/s) | policy | router cache hits | blocks computed | slow prefills "
        "(> 0.7 s) | prefix affinity | prefix moves (while busier) | served by decode-0 / "
        "decode-1 | other jobs' CPU (cores) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in range(len(runs[0]["points"])):
        for run in runs:
            point = run["points"][k]
            rate, p = f"{point['point']['rate']:g}", point_rows(point)
            t, i, (lo, hi) = p["ttft"], p["itl"], p["ttft_p50_ci"]
            latency.append(
                f"| {rate} ({p['arrival_rate']:.2f}) | {run['policy']} | "
                f"{t['p50']:.2f} [{lo:.2f}, {hi:.2f}] | "
                f"{t['p90']:.2f} / {t['p99']:.2f} | {i['p50'] * 1e3:.0f} / {i['p99'] * 1e3:.0f} | "
                f"{p['tpot']['p50'] * 1e3:.0f} | {p['requests_per_s']:.2f} | "
                f"{p['output_tokens_per_s']:.1f} | {p['goodput']:.2f} ({p['attainment']:.0%}) |"
            )
            m, served = p["moves"], p["served"]
            routing.append(
                f"| {rate} | {run['policy']} | {p['hits']:.0f}/{p['decisions']:.0f} "
                f"({p['hits'] / p['decisions']:.0%}) | {p['blocks_computed']} | "
                f"{p['slow_prefills']}/{p['num_measured']} | {p['affinity']:.0%} | "
                f"{m['moved']}/{m['moved'] + m['stayed']} ({m['moved_busier']}) | "
                f"{served['decode-0']} / {served['decode-1']} | {p['external_cores']:.2f} |"
            )
    return "\n".join(latency) + "\n\n" + "\n".join(routing)


def repeats(named: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> str:
    """Key figures of several runs of the same command side by side, one row per point."""
    lines = [
        "| rate (req/s) | policy | run | TTFT p50 / p90 (s) | goodput req/s | router cache hits "
        "| blocks computed |",
        "|---|---|---|---|---|---|---|",
    ]
    first = named[0][1]
    for k in range(len(first[0]["points"])):
        for i, run in enumerate(first):
            for name, runs in named:
                point = runs[i]["points"][k]
                p = point_rows(point)
                lines.append(
                    f"| {point['point']['rate']:g} | {run['policy']} | {name} | "
                    f"{p['ttft']['p50']:.2f} / {p['ttft']['p90']:.2f} | {p['goodput']:.2f} | "
                    f"{p['hits'] / p['decisions']:.0%} | {p['blocks_computed']} |"
                )
    return "\n".join(lines)


def plot(runs: Sequence[dict[str, Any]], path: Path) -> None:
    """TTFT p50/p90/p99 per policy, one panel per rate, the router's hit rate under each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_rates = len(runs[0]["points"])
    fig, axes = plt.subplots(1, num_rates, figsize=(5 * num_rates, 4), squeeze=False)
    for k, ax in enumerate(axes[0]):
        width = 0.25
        for j, q in enumerate(("p50", "p90", "p99")):
            ys = [run["points"][k]["summary"]["ttft_s"][q] for run in runs]
            xs = [x + (j - 1) * width for x in range(len(runs))]
            ax.bar(xs, ys, width, label=q)
        labels = [
            f"{run['policy']}\nhits {run['points'][k]['servers']['cache_hit_rate']:.0%}"
            for run in runs
        ]
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels(labels)
        ax.set(title=f"TTFT, Poisson {runs[0]['points'][k]['point']['rate']:g} req/s",
               ylabel="seconds")  # fmt: skip
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("results", type=Path, nargs="+", help="results.json; more: repeats of it")
    p.add_argument("--plot", type=Path, help="write the TTFT plot (of the first file) here")
    args = p.parse_args(argv)
    named = [(path.name, json.loads(path.read_text())["runs"]) for path in args.results]
    print(tables(named[0][1]))
    print("\n" + cache_and_load_table(named[0][1]))
    if len(named) > 1:
        print("\n" + repeats(named))
    if args.plot:
        plot(named[0][1], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
