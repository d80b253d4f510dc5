"""The pure helpers of bench/routing/run.py: what it reads from the servers and how it counts."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvrail.testing.scripts import load_script

RUN_PATH = Path(__file__).resolve().parents[3] / "bench" / "routing" / "run.py"


run: Any = load_script("kvrail_bench_routing_run", RUN_PATH)
report: Any = run.reporting


def test_first_token_lines_give_each_requests_prefill_time(tmp_path: Path) -> None:
    log = tmp_path / "decode-0.0.log"
    log.write_text(
        "2026-11-29 13:36:09,066 INFO kvrail.worker.roles.decode first token "
        "request_id=chatcmpl-a1 mode=local prompt_tokens=432 admission_s=0.0001 "
        "prefill_compute_s=8.6923\n"
        "2026-11-29 13:36:10,000 INFO kvrail.worker.roles.decode request cancelled request_id=x\n"
        "2026-11-29 13:36:17,327 INFO kvrail.worker.roles.decode first token "
        "request_id=chatcmpl-b2 mode=local prompt_tokens=424 admission_s=0.0000 "
        "prefill_compute_s=0.2129\n"
    )
    assert run.first_tokens(log) == {"chatcmpl-a1": 8.6923, "chatcmpl-b2": 0.2129}


def req(prefix: int | None, worker: str | None, start: float = 0.0, e2e: float = 1.0) -> Any:
    return {"prefix_id": prefix, "worker": worker, "start_s": start, "e2e_s": e2e}


def test_prefix_affinity_is_the_share_served_by_each_prefixs_main_worker() -> None:
    sticky = [req(0, "a"), req(0, "a"), req(1, "b"), req(1, "b")]
    assert report.prefix_affinity(sticky) == 1.0
    alternating = [req(0, "a"), req(0, "b"), req(1, "a"), req(1, "b")]
    assert report.prefix_affinity(alternating) == 0.5
    mixed = [req(0, "a"), req(0, "a"), req(0, "b"), req(None, "a"), req(1, None)]
    assert report.prefix_affinity(mixed) == pytest.approx(2 / 3)
    assert report.prefix_affinity([]) is None


def test_a_prefix_move_counts_as_busier_when_its_last_worker_had_more_in_flight() -> None:
    requests = [
        req(0, "a", start=0.0, e2e=10.0),  # first of prefix 0: no move
        req(1, "b", start=1.0, e2e=0.5),  # first of prefix 1
        req(0, "a", start=2.0, e2e=1.0),  # stayed
        req(0, "b", start=2.5, e2e=1.0),  # moved; "a" runs two requests, "b" none: busier
        req(1, "a", start=5.0, e2e=1.0),  # moved; "a" 1 in flight, "b" 0: the old worker is idle
    ]  # fmt: skip
    assert report.prefix_moves(requests) == {"stayed": 1, "moved": 2, "moved_busier": 1}
    # Arrival order decides, not list order.
    assert report.prefix_moves(requests[::-1]) == report.prefix_moves(requests)


def test_the_bootstrap_interval_brackets_the_median_and_narrows_with_more_data() -> None:
    rng = random.Random(3)
    small = [rng.expovariate(1.0) for _ in range(30)]
    large = [rng.expovariate(1.0) for _ in range(3000)]
    for values in (small, large):
        lo, hi = report.bootstrap_interval(values, 50)
        assert lo <= report.percentile(values, 50) <= hi
    assert report.bootstrap_interval(small, 50) == report.bootstrap_interval(small, 50)  # seeded
    width = [hi - lo for lo, hi in (report.bootstrap_interval(v, 50) for v in (small, large))]
    assert width[1] < width[0] / 4
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    with pytest.raises(ValueError, match="no values"):
        report.bootstrap_interval([], 50)


def test_server_stats_are_differences_and_the_hit_rate_comes_from_the_router() -> None:
    before = {
        "router": {"decisions_hit": 3.0, "decisions_miss": 2.0,
                   "prefill_compute_sum": 4.0, "prefill_compute_count": 5.0},
        "kv": {"blocks_stored": {"decode-0": 50}, "blocks_removed": {},
               "distinct_blocks_stored_by_both": 10},
        "served": {"decode-0": 5, "decode-1": 0},
    }  # fmt: skip
    after = {
        "router": {"decisions_hit": 9.0, "decisions_miss": 4.0,
                   "prefill_compute_sum": 10.0, "prefill_compute_count": 13.0},
        "kv": {"blocks_stored": {"decode-0": 80, "decode-1": 25}, "blocks_removed": {"decode-0": 7},
               "distinct_blocks_stored_by_both": 12},
        "served": {"decode-0": 9, "decode-1": 4},
    }  # fmt: skip
    d = run.server_stats(before, after)
    assert d["router"]["decisions_hit"] == 6 and d["router"]["decisions_miss"] == 2
    assert d["cache_hit_rate"] == pytest.approx(6 / 8)
    assert d["prefill_compute_mean_s"] == pytest.approx(6.0 / 8)
    assert d["kv"]["blocks_stored"] == {"decode-0": 30, "decode-1": 25}
    assert d["kv"]["blocks_removed"] == {"decode-0": 7}
    assert d["kv"]["distinct_blocks_stored_by_both"] == 12  # a state, not a counter
    assert d["served"] == {"decode-0": 4, "decode-1": 4}
    nothing = run.server_stats(before, before)
    assert nothing["cache_hit_rate"] is None and nothing["prefill_compute_mean_s"] is None


_CPU_METER_PROBE = """
import os, sys, time
from pathlib import Path
from kvrail.testing.scripts import load_script
run = load_script("kvrail_bench_routing_run", Path(sys.argv[1]))
ours = run.tree_jiffies(os.getpid())
assert os.getpid() in ours and all(t >= 0 for t in ours.values())
meter = run.CpuMeter()
cpu0, wall0 = time.process_time(), time.monotonic()
while time.process_time() - cpu0 < 0.3:  # keep one core busy in this process
    pass
busy, external = meter.sample()
print(busy - external, (time.process_time() - cpu0) / (time.monotonic() - wall0))
"""


def test_the_cpu_meter_counts_this_process_as_ours() -> None:
    """In a fresh process: this pytest process's tree holds the session's servers (the kube
    control plane among them), whose CPU the meter would rightly count as ours too."""
    probe = subprocess.run(
        [sys.executable, "-P", "-c", _CPU_METER_PROBE, str(RUN_PATH)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    counted, our_cores = (float(v) for v in probe.stdout.split())
    assert counted == pytest.approx(our_cores, abs=0.25)


def test_the_report_renders_the_committed_results() -> None:
    results = RUN_PATH.parent / "results.json"
    runs = json.loads(results.read_text())["runs"]
    text = report.tables(runs)
    lines = [line for line in text.splitlines() if line.startswith("| 0") or line.startswith("| 1")]
    num_points = sum(len(run["points"]) for run in runs)
    assert len(lines) == 2 * num_points  # one row per point in each table
    for run in runs:
        for point in run["points"]:
            p50 = point["summary"]["ttft_s"]["p50"]
            assert f"| {run['policy']} | {p50:.2f} [" in text
    assert "results.json" in report.repeats([("results.json", runs), ("again.json", runs)])


def test_ttft_is_grouped_by_prefix_seen_on_the_worker_and_its_load() -> None:
    def done(prefix: int, worker: str, start: float, e2e: float, ttft: float) -> Any:
        return {**req(prefix, worker, start, e2e), "ttft_s": ttft}

    point = {"requests": [
        done(0, "a", 0.0, 5.0, 1.1),  # prefix new on "a", "a" idle
        done(0, "a", 1.0, 1.0, 0.2),  # seen on "a", one in flight there
        done(0, "b", 1.5, 1.0, 1.2),  # new on "b", "b" idle
        done(1, "a", 1.6, 1.0, 1.5),  # new on "a", two in flight there
        {**done(1, "a", 9.0, 1.0, 0.0), "ttft_s": None},  # failed: not counted
    ]}  # fmt: skip
    groups = report.ttft_by_cache_and_load([{"points": [point]}])
    assert groups == {(False, 0): [1.1, 1.2], (True, 1): [0.2], (False, 2): [1.5]}
    assert "| no | 2 or more | 1 | 1.50 |" in report.cache_and_load_table([{"points": [point]}])
