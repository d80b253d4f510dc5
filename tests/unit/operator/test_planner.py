"""The planner on recorded traces: each row is one tick (time, load) and what the planner must
decide. A trace is replayed as the operator would: an applied decision becomes the StatefulSet's
size for the next tick (a dry-run decision does not)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from kvrail.crd.pool import InferencePool
from kvrail.operator.autoscale import planner as p
from kvrail.operator.autoscale.planner import DecodeLoad, PlannerState, PrefillLoad, Signals, plan
from kvrail.operator.testing import make_pool, mutate, pool_manifest

# Windows in seconds: up 10, down 30, cooldown 0; 4 jobs (or 1000 tokens) per prefill replica;
# decode at 80 % KV; both roles 1..8.
BASE = (
    ("spec.autoscaling.enabled", True),
    ("spec.autoscaling.intervalSeconds", 5),
    ("spec.autoscaling.scaleUpStabilizationSeconds", 10),
    ("spec.autoscaling.scaleDownStabilizationSeconds", 30),
    ("spec.autoscaling.cooldownSeconds", 0),
    ("spec.autoscaling.prefillQueueTarget", 4),
    ("spec.autoscaling.prefillQueueTokensTarget", 1000),
    ("spec.autoscaling.decodeKvUtilizationTarget", 80),
    ("spec.prefill.minReplicas", 1),
    ("spec.prefill.maxReplicas", 8),
    ("spec.decode.maxReplicas", 8),
)


def pool(*changes: tuple[str, Any]) -> InferencePool:
    return make_pool(mutate(pool_manifest(), *BASE, *changes))


def jobs(n: int, tokens: int = 0) -> PrefillLoad | None:
    return PrefillLoad(n, tokens, 0.0)


def kv(workers: int, each: float, running: int = 0) -> DecodeLoad:
    return DecodeLoad(workers, workers * each, running, 0, 0.0)


Row = tuple[float, Any, int, str]  # (time, load, expected desired, expected reason)


def replay(
    the_pool: InferencePool, role: p.Role, rows: Sequence[Row], start: int = 1
) -> list[p.Decision]:
    """Feed one role's loads tick by tick; assert every row; return the decisions."""
    state, current, out = PlannerState(), {"prefill": 1, "decode": 1}, []
    current[role] = start
    for t, load, desired, reason in rows:
        stamped = _stamp(load, t)
        signals = (
            Signals(prefill=stamped, decode=kv(1, 0.8), prefill_error="down")
            if role == "prefill"
            else Signals(prefill=jobs(4), decode=stamped, decode_error="down")
        )
        result = plan(the_pool, signals, current, state, t)
        (d,) = [d for d in result.decisions if d.role == role]
        assert (t, d.desired, d.reason) == (t, desired, reason), d.message
        state = result.state
        if d.is_applied:
            current[role] = d.desired
        out.append(d)
    return out


def _stamp(load: PrefillLoad | DecodeLoad | None, t: float) -> Any:
    return None if load is None else replace(load, observed_at_s=t)


BURST: list[Row] = [
    (0, jobs(0), 1, p.AT_MIN_REPLICAS),
    (5, jobs(20), 1, p.STABILIZING_UP),  # 20 jobs / 4 = 5 replicas, held for 10 s first
    (10, jobs(20), 1, p.STABILIZING_UP),
    (15, jobs(20), 5, p.SCALE_UP),
    (20, jobs(20), 5, p.STEADY),
]
BURST_IN_TOKENS: list[Row] = [
    (0, jobs(2, 6000), 1, p.STABILIZING_UP),  # 2 jobs, but 6000 tokens / 1000 = 6 replicas
    (5, jobs(2, 6000), 1, p.STABILIZING_UP),
    (10, jobs(2, 6000), 6, p.SCALE_UP),
]
STEADY: list[Row] = [
    (0, jobs(12), 3, p.STEADY),
    (5, jobs(13), 3, p.STEADY),  # 3.25 replicas' worth: within the 10 % tolerance
    (10, jobs(11), 3, p.STEADY),
]
DRAIN: list[Row] = [
    (0, jobs(20), 5, p.STEADY),
    (5, jobs(0), 5, p.STABILIZING_DOWN),
    (20, jobs(0), 5, p.STABILIZING_DOWN),
    (30, jobs(0), 5, p.STABILIZING_DOWN),  # the recommendation of 5 at t=0 is still in the window
    (35, jobs(0), 1, p.SCALE_DOWN),
    (40, jobs(0), 1, p.AT_MIN_REPLICAS),
]
FLAPPING: list[Row] = [(t, jobs(20 if t % 10 else 0), 1, p.STABILIZING_UP if t % 10 else
                        p.AT_MIN_REPLICAS) for t in range(0, 60, 5)]  # fmt: skip
FLAPPING_DOWN: list[Row] = [(t, jobs(0 if t % 10 else 20), 5, p.STABILIZING_DOWN if t % 10 else
                             p.STEADY) for t in range(0, 60, 5)]  # fmt: skip
CLAMPED: list[Row] = [
    (0, jobs(400), 8, p.SCALE_UP),  # 100 replicas' worth, capped at max
    (5, jobs(400), 8, p.AT_MAX_REPLICAS),
]
MISSING: list[Row] = [
    (0, jobs(20), 1, p.STABILIZING_UP),
    (5, None, 1, p.SIGNALS_MISSING),  # counts as recommending 1: the up window starts again
    (10, jobs(20), 1, p.STABILIZING_UP),
    (15, jobs(20), 1, p.STABILIZING_UP),
    (20, jobs(20), 5, p.SCALE_UP),
]


@pytest.mark.parametrize(
    ("rows", "start", "changes"),
    [
        pytest.param(BURST, 1, (), id="burst"),
        pytest.param(BURST_IN_TOKENS, 1, (), id="burst-in-tokens"),
        pytest.param(STEADY, 3, (), id="steady"),
        pytest.param(DRAIN, 5, (), id="drain"),
        pytest.param(FLAPPING, 1, (), id="flapping-never-scales-up"),
        pytest.param(FLAPPING_DOWN, 5, (), id="flapping-never-scales-down"),
        pytest.param(CLAMPED, 1, (("spec.autoscaling.scaleUpStabilizationSeconds", 0),), id="max"),
        pytest.param(MISSING, 1, (), id="missing-signals-hold"),
    ],
)
def test_prefill_traces(rows: list[Row], start: int, changes: tuple[tuple[str, Any], ...]) -> None:
    replay(pool(*changes), "prefill", rows, start)


def test_stale_signals_never_scale_even_with_a_huge_backlog() -> None:
    the_pool = pool(("spec.autoscaling.scaleUpStabilizationSeconds", 0))
    old = PrefillLoad(400, 0, observed_at_s=0.0)
    result = plan(the_pool, Signals(prefill=old, decode=kv(1, 0.8)), {"prefill": 1}, PlannerState(),
                  now_s=16.0)  # fmt: skip
    (d,) = result.decisions
    assert (d.desired, d.reason) == (1, p.SIGNALS_STALE)
    assert "16s old" in d.message


def test_cooldown_holds_a_second_change_then_lets_it_through() -> None:
    the_pool = pool(
        ("spec.autoscaling.scaleUpStabilizationSeconds", 0),
        ("spec.autoscaling.cooldownSeconds", 20),
    )
    replay(the_pool, "prefill", [
        (0, jobs(20), 5, p.SCALE_UP),
        (5, jobs(32), 5, p.COOLDOWN),
        (15, jobs(32), 5, p.COOLDOWN),
        (20, jobs(32), 8, p.SCALE_UP),
    ])  # fmt: skip


def test_dry_run_decides_and_records_but_never_applies() -> None:
    the_pool = pool(("spec.autoscaling.dryRun", True), ("spec.autoscaling.cooldownSeconds", 30))
    decisions = replay(the_pool, "prefill", [
        (0, jobs(20), 1, p.STABILIZING_UP),
        (10, jobs(20), 5, p.SCALE_UP),
        (15, jobs(20), 5, p.SCALE_UP),  # no cooldown: nothing changed
    ])  # fmt: skip
    assert all(d.dry_run and not d.is_applied for d in decisions)
    assert decisions[1].current == decisions[2].current == 1
    assert decisions[1].message.startswith("dry run: ")


def test_a_size_outside_new_bounds_is_clamped_at_once_even_without_signals() -> None:
    the_pool = pool(("spec.prefill.maxReplicas", 3))
    result = plan(the_pool, Signals(), {"prefill": 6, "decode": 1}, PlannerState(), now_s=0.0)
    by_role = {d.role: d for d in result.decisions}
    assert (by_role["prefill"].desired, by_role["prefill"].reason) == (3, p.ABOVE_MAX_REPLICAS)
    assert (by_role["decode"].desired, by_role["decode"].reason) == (1, p.SIGNALS_MISSING)


DECODE_UP: list[Row] = [
    (0, kv(1, 0.95), 1, p.STABILIZING_UP),  # 95 % on one worker at an 80 % target: 2 replicas
    (5, kv(1, 0.95), 1, p.STABILIZING_UP),
    (10, kv(1, 0.95), 2, p.SCALE_UP),
    (15, kv(1, 0.95), 2, p.STEADY),  # the new worker does not report yet: counts as idle going up
    (20, kv(2, 0.3), 2, p.STABILIZING_DOWN),  # 2 x 30 % needs 1 replica: held for 30 s
]
DECODE_NO_REPORTS: list[Row] = [
    (0, kv(0, 0.0), 1, p.SIGNALS_MISSING),
    (5, None, 1, p.SIGNALS_MISSING),
]


@pytest.mark.parametrize(
    ("rows", "start"),
    [pytest.param(DECODE_UP, 1, id="kv-up"), pytest.param(DECODE_NO_REPORTS, 1, id="no-reports")],
)
def test_decode_traces(rows: list[Row], start: int) -> None:
    replay(pool(), "decode", rows, start)


def test_decode_workers_not_reporting_yet_count_as_loaded_on_the_way_down() -> None:
    # 4 replicas, only 1 reports (10 %): 0.125 replicas' worth reported, 3 assumed at target.
    the_pool = pool(("spec.autoscaling.scaleDownStabilizationSeconds", 0))
    result = plan(the_pool, Signals(decode=kv(1, 0.1)), {"decode": 4}, PlannerState(), 0.0)
    (d,) = result.decisions
    assert (d.desired, d.reason) == (4, p.STEADY)


def test_decode_scales_on_requests_when_a_requests_target_is_set() -> None:
    the_pool = pool(("spec.autoscaling.decodeRequestsTarget", 10),
                    ("spec.autoscaling.scaleUpStabilizationSeconds", 0))  # fmt: skip
    result = plan(the_pool, Signals(decode=kv(2, 0.1, running=60)), {"decode": 2}, PlannerState(),
                  0.0)  # fmt: skip
    (d,) = result.decisions
    assert (d.desired, d.reason) == (6, p.SCALE_UP)


def test_each_role_moves_on_its_own_signal_only() -> None:
    the_pool = pool(("spec.autoscaling.scaleUpStabilizationSeconds", 0))
    busy_prefill = Signals(prefill=jobs(20), decode=kv(1, 0.8))
    busy_decode = Signals(prefill=jobs(0), decode=kv(1, 1.0))
    current = {"prefill": 1, "decode": 1}
    up = {d.role: d for d in plan(the_pool, busy_prefill, current, PlannerState(), 0).decisions}
    assert (up["prefill"].desired, up["decode"].desired) == (5, 1)
    up = {d.role: d for d in plan(the_pool, busy_decode, current, PlannerState(), 0).decisions}
    assert (up["prefill"].desired, up["decode"].desired) == (1, 2)


def test_a_vllm_pools_prefill_pool_holds_its_size_and_its_decode_pool_still_scales() -> None:
    the_pool = pool(
        ("spec.autoscaling.scaleUpStabilizationSeconds", 0),
        ("spec.engine.kind", "vllm"),
        ("spec.model.source", "/models/tiny"),
    )
    assert not p.has_prefill_queue(the_pool)
    idle_queue = Signals(prefill=jobs(0), decode=kv(1, 1.0))  # an empty queue is no signal here
    current = {"prefill": 3, "decode": 1}
    made = {d.role: d for d in plan(the_pool, idle_queue, current, PlannerState(), 0).decisions}
    assert (made["prefill"].desired, made["prefill"].reason) == (3, p.SIGNALS_MISSING)
    assert made["prefill"].message.endswith(p.NO_PREFILL_QUEUE)
    assert made["decode"].desired == 2


def test_a_role_without_a_statefulset_yet_is_not_planned() -> None:
    result = plan(pool(), Signals(prefill=jobs(20)), {"decode": 1}, PlannerState(), 0.0)
    assert [d.role for d in result.decisions] == ["decode"]


def test_bounds_default_min_is_one_and_signals_go_stale_after_three_intervals() -> None:
    limits = p.bounds(pool(("spec.autoscaling.intervalSeconds", 2)), "decode")
    assert (limits.min_replicas, limits.max_replicas, limits.max_signal_age_s) == (1, 8, 6)


def test_history_keeps_only_the_longer_window() -> None:
    the_pool = pool()
    state = PlannerState()
    for t in range(0, 100, 5):
        state = plan(the_pool, Signals(prefill=jobs(4)), {"prefill": 1}, state, float(t)).state
    assert min(t for t, _ in state.role("prefill").history) >= 95 - 30
