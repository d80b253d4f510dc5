"""The planner: how many prefill and decode replicas a pool should run, and why. Pure.

`plan()` takes the signals read this tick, the StatefulSets' current replicas, the previous
`PlannerState`, the pool's spec and the time, and returns one `Decision` per role and the new
state. It never reads a clock or a server; `kvrail.operator.autoscale.signals` reads the
signals and the handler applies the decisions.

Each role is decided on its own signal, never on the other's (coupled pools are a failure users
report in other systems):

- prefill: queued jobs and queued prompt tokens in the pool's JetStream stream, against
  `prefillQueueTarget` jobs and `prefillQueueTokensTarget` tokens per replica;
- decode: the sum of the ready workers' KV-cache utilization against
  `decodeKvUtilizationTarget` percent per replica, and optionally running plus waiting requests
  against `decodeRequestsTarget` per replica.

The raw recommendation is `ceil(load / target per replica)` (within a 10 % tolerance of the
current size, the current size), clamped to [min, max]. Then, per role, like the Horizontal Pod
Autoscaler's stabilization windows:

- every tick appends its recommendation to the role's history (a tick whose signals are missing or
  stale appends the current size: it recommends holding);
- time before the planner's first tick counts as recommending the current size too, so a fresh
  planner (or a restarted operator) waits a full window before it acts;
- scale up to the lowest recommendation of the last `scaleUpStabilizationSeconds`: a higher size
  must have been wanted for the whole window;
- scale down to the highest recommendation of the last `scaleDownStabilizationSeconds`: a lower
  size must have been wanted for the whole window, so a short lull (or flapping load) keeps the
  replicas;
- after a change, the role keeps its size for `cooldownSeconds`;
- a size outside [min, max] (bounds just edited) is clamped at once, windows and cooldown aside.

Missing or stale signals never move a role: the decision is to hold, with a reason that says
why. In dry-run mode the decisions are the same but nothing is applied, so the cooldown never
starts and the planner keeps recommending the change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from kvrail.crd.pool import InferencePool
from kvrail.crd.spec import AutoscalingSpec

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
TOLERANCE = 0.1
"""A load within 10 % of what the current size serves at target recommends the current size."""
DEFAULT_MIN_REPLICAS = 1

# Reasons (CamelCase, as in conditions).
SCALE_UP = "ScaleUp"
SCALE_DOWN = "ScaleDown"
STEADY = "Steady"
STABILIZING_UP = "StabilizingUp"
STABILIZING_DOWN = "StabilizingDown"
COOLDOWN = "CooldownActive"
AT_MAX_REPLICAS = "AtMaxReplicas"
AT_MIN_REPLICAS = "AtMinReplicas"
BELOW_MIN_REPLICAS = "BelowMinReplicas"
ABOVE_MAX_REPLICAS = "AboveMaxReplicas"
SIGNALS_MISSING = "SignalsMissing"
NO_PREFILL_QUEUE = "no prefill queue in a vLLM pool: the prefill pool keeps its size"
SIGNALS_STALE = "SignalsStale"


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """The prefill backlog, read at `observed_at_s` (unix seconds)."""

    num_jobs: int
    num_tokens: int
    observed_at_s: float


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """What the ready decode workers reported in etcd, read at `observed_at_s` (unix seconds)."""

    num_workers: int
    kv_utilization_sum: float
    """Sum of the workers' KV-cache utilization, each a fraction in [0, 1]."""
    num_running: int
    num_waiting: int
    observed_at_s: float

    @property
    def kv_utilization_percent(self) -> int:
        if self.num_workers == 0:
            return 0
        return min(100, round(100 * self.kv_utilization_sum / self.num_workers))


@dataclass(frozen=True, slots=True)
class Signals:
    """One tick's signals; None where a signal could not be read, with the error in `*_error`."""

    prefill: PrefillLoad | None = None
    decode: DecodeLoad | None = None
    prefill_error: str = "not read"
    decode_error: str = "not read"


@dataclass(frozen=True, slots=True)
class RoleState:
    """What the planner remembers of one role between ticks."""

    since_s: float | None = None
    """The first tick (None before it)."""
    history: tuple[tuple[float, int], ...] = ()
    """(time, recommendation) of the ticks within the longer stabilization window."""
    last_scale_s: float | None = None
    """When the planner last changed this role's replicas (dry-run never sets it)."""


@dataclass(frozen=True, slots=True)
class PlannerState:
    roles: Mapping[Role, RoleState] = field(default_factory=dict)

    def role(self, role: Role) -> RoleState:
        return self.roles.get(role, RoleState())


@dataclass(frozen=True, slots=True)
class Decision:
    """The planner's answer for one role."""

    role: Role
    current: int
    desired: int
    reason: str
    message: str
    recommendation: int | None
    """The clamped recommendation of this tick alone; None when the signals could not be used."""
    dry_run: bool = False
    prefill: PrefillLoad | None = None
    decode: DecodeLoad | None = None

    @property
    def is_change(self) -> bool:
        return self.desired != self.current

    @property
    def is_applied(self) -> bool:
        """The handler must set the StatefulSet's replicas to `desired`."""
        return self.is_change and not self.dry_run


@dataclass(frozen=True, slots=True)
class Plan:
    decisions: tuple[Decision, ...]
    state: PlannerState


@dataclass(frozen=True, slots=True)
class Bounds:
    """One role's policy: replica bounds and timing, from the pool's spec."""

    min_replicas: int
    max_replicas: int
    up_window_s: float
    down_window_s: float
    cooldown_s: float
    max_signal_age_s: float

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


def bounds(pool: InferencePool, role: Role) -> Bounds:
    """The planner's bounds for `role`: `minReplicas` (default 1) to `maxReplicas` (required
    by the CRD when autoscaling; `replicas` otherwise). Signals older than three planning
    intervals are stale."""
    spec = pool.role(role)
    if spec is None:
        raise ValueError(f"pool {pool.metadata.name} has no {role} pool")
    a = pool.spec.autoscaling
    lo = spec.min_replicas if spec.min_replicas is not None else DEFAULT_MIN_REPLICAS
    hi = spec.max_replicas if spec.max_replicas is not None else max(lo, spec.replicas)
    return Bounds(
        min_replicas=lo,
        max_replicas=max(lo, hi),
        up_window_s=a.scale_up_stabilization_seconds,
        down_window_s=a.scale_down_stabilization_seconds,
        cooldown_s=a.cooldown_seconds,
        max_signal_age_s=3 * a.interval_seconds,
    )


def plan(
    pool: InferencePool,
    signals: Signals,
    current: Mapping[Role, int],
    state: PlannerState,
    now_s: float,
) -> Plan:
    """Decide every role of `pool` present in `current` (a role whose StatefulSet does not exist
    yet is left out)."""
    a = pool.spec.autoscaling
    decisions = []
    roles = dict(state.roles)
    for role in ROLES:
        if pool.role(role) is None or role not in current:
            roles.pop(role, None)
            continue
        limits = bounds(pool, role)
        cur = current[role]
        need: float | None
        problem: str | None
        if role == "prefill" and not has_prefill_queue(pool):
            need, note, problem = None, NO_PREFILL_QUEUE, SIGNALS_MISSING
        elif role == "prefill":
            need, note, problem = _prefill_need(signals, a, now_s, limits)
        else:
            need, note, problem = _decode_need(signals, a, cur, now_s, limits)
        decision, roles[role] = decide(
            role, cur, need, note, problem, state.role(role), limits, now_s, a.dry_run
        )
        decisions.append(
            replace(
                decision,
                prefill=signals.prefill if role == "prefill" else None,
                decode=signals.decode if role == "decode" else None,
            )
        )
    return Plan(tuple(decisions), PlannerState(roles))


def recommend(need: float, current: int) -> int:
    """Replicas for `need` replicas' worth of load: the current size within the tolerance, else
    the ceiling."""
    if current > 0 and abs(need / current - 1) <= TOLERANCE:
        return current
    return math.ceil(need - 1e-9)


def decide(
    role: Role,
    current: int,
    need: float | None,
    note: str,
    problem: str | None,
    state: RoleState,
    limits: Bounds,
    now_s: float,
    dry_run: bool = False,
) -> tuple[Decision, RoleState]:
    """One role's decision from its load (`need`, in replicas at target; None with `problem` set
    to a reason when the signals cannot be used), stabilized against its history."""
    since = state.since_s if state.since_s is not None else now_s
    keep_s = max(limits.up_window_s, limits.down_window_s)
    raw = None if need is None else recommend(need, current)
    recommendation = None if raw is None else limits.clamp(raw)
    sample = current if recommendation is None else recommendation
    history = tuple((t, r) for t, r in state.history if t >= now_s - keep_s) + ((now_s, sample),)
    last_scale = state.last_scale_s

    def made(desired: int, reason: str, message: str) -> tuple[Decision, RoleState]:
        scaled = desired != current and not dry_run
        new_state = RoleState(since, history, now_s if scaled else last_scale)
        text = f"dry run: {message}" if dry_run else message
        return Decision(role, current, desired, reason, text, recommendation, dry_run), new_state

    if current < limits.min_replicas or current > limits.max_replicas:
        desired = limits.clamp(current)
        reason = BELOW_MIN_REPLICAS if current < limits.min_replicas else ABOVE_MAX_REPLICAS
        return made(
            desired,
            reason,
            f"{current} replicas outside [{limits.min_replicas}, {limits.max_replicas}]: {desired}",
        )
    if recommendation is None:
        return made(current, problem or SIGNALS_MISSING, f"holding {current}: {note}")

    up_floor = _window(history, now_s, limits.up_window_s, since, current, min)
    down_ceiling = _window(history, now_s, limits.down_window_s, since, current, max)
    target = current
    if up_floor > current:
        target = up_floor
    elif down_ceiling < current:
        target = down_ceiling
    wants = f"{note}: recommends {recommendation}"
    if target == current:
        if recommendation > current:
            return made(
                current,
                STABILIZING_UP,
                f"{wants}, holding {current} until that has held for {limits.up_window_s:g}s",
            )
        if recommendation < current:
            return made(
                current,
                STABILIZING_DOWN,
                f"{wants}, holding {current} until that has held for {limits.down_window_s:g}s",
            )
        if raw is not None and raw > limits.max_replicas:
            return made(current, AT_MAX_REPLICAS, f"{note}: wants {raw}, capped at max {current}")
        if raw is not None and raw < limits.min_replicas:
            return made(current, AT_MIN_REPLICAS, f"{note}: wants {raw}, kept at min {current}")
        return made(current, STEADY, f"{wants}, steady at {current}")
    if last_scale is not None and now_s - last_scale < limits.cooldown_s:
        left = limits.cooldown_s - (now_s - last_scale)
        return made(current, COOLDOWN, f"{wants}, stabilized {target}; cooldown {left:.0f}s left")
    reason = SCALE_UP if target > current else SCALE_DOWN
    return made(target, reason, f"{wants}, stabilized {target}: {current} -> {target}")


def _window(
    history: tuple[tuple[float, int], ...],
    now_s: float,
    window_s: float,
    since_s: float,
    current: int,
    pick: Callable[[list[int]], int],
) -> int:
    samples = [r for t, r in history if t >= now_s - window_s]
    if since_s > now_s - window_s:
        samples.append(current)  # the planner did not observe the start of the window
    return pick(samples)


def has_prefill_queue(pool: InferencePool) -> bool:
    """Whether the pool's prefill role is fed by the JetStream queue the planner reads. A vLLM
    pool's router sends each prefill straight to a server, so there is no backlog to read: the
    planner holds its prefill pool at its size (and says so) instead of reading an empty queue as
    idle and scaling it down."""
    return pool.spec.engine.kind == "kvrail"


def _stale(observed_at_s: float, now_s: float, limits: Bounds) -> bool:
    return now_s - observed_at_s > limits.max_signal_age_s


def _prefill_need(
    signals: Signals, a: AutoscalingSpec, now_s: float, limits: Bounds
) -> tuple[float | None, str, str | None]:
    load = signals.prefill
    if load is None:
        return None, f"no prefill backlog ({signals.prefill_error})", SIGNALS_MISSING
    if _stale(load.observed_at_s, now_s, limits):
        age = now_s - load.observed_at_s
        return None, f"prefill backlog is {age:.0f}s old", SIGNALS_STALE
    need = max(
        load.num_jobs / a.prefill_queue_target, load.num_tokens / a.prefill_queue_tokens_target
    )
    note = f"backlog {load.num_jobs} jobs, {load.num_tokens} tokens"
    return need, note, None


def _decode_need(
    signals: Signals, a: AutoscalingSpec, current: int, now_s: float, limits: Bounds
) -> tuple[float | None, str, str | None]:
    load = signals.decode
    if load is None:
        return None, f"no decode load ({signals.decode_error})", SIGNALS_MISSING
    if _stale(load.observed_at_s, now_s, limits):
        age = now_s - load.observed_at_s
        return None, f"decode load is {age:.0f}s old", SIGNALS_STALE
    if load.num_workers == 0:
        return None, "no ready decode worker reports its load", SIGNALS_MISSING
    need = 100 * load.kv_utilization_sum / a.decode_kv_utilization_target
    if a.decode_requests_target is not None:
        need = max(need, (load.num_running + load.num_waiting) / a.decode_requests_target)
    missing = max(current - load.num_workers, 0)
    if need < current and missing:
        # Like the HPA: workers that do not report yet count as loaded at target on the way
        # down (a pod still starting must not shrink the pool) and as idle on the way up.
        need = min(float(current), need + missing)
    note = (
        f"{load.num_workers} workers, KV {load.kv_utilization_percent}%, "
        f"{load.num_running} running, {load.num_waiting} waiting"
    )
    return need, note, None
