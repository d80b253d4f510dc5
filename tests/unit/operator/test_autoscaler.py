"""What a planner tick records: the status entry per role, when it is rewritten, which Events are
posted; and which endpoints a pool's cleanup and signals use."""

from __future__ import annotations

from kvrail.crd.infrastructure import InfrastructureSpec
from kvrail.operator.autoscale import planner as p
from kvrail.operator.autoscale.autoscaler import RECORD_EVERY_S, decision_status, record, rfc3339
from kvrail.operator.autoscale.planner import Decision, PlannerState, PrefillLoad, RoleState
from kvrail.operator.planes import pool_settings
from kvrail.settings import Settings

T0 = 1_800_000_000.0


def decision(current: int, desired: int, reason: str, dry_run: bool = False) -> Decision:
    load = PrefillLoad(20, 2000, T0)
    return Decision("prefill", current, desired, reason, "m", desired, dry_run, prefill=load)


def test_status_entry_carries_sizes_reason_inputs_and_times() -> None:
    entry = decision_status(decision(1, 5, p.SCALE_UP), T0, T0)
    assert entry == {
        "currentReplicas": 1, "desiredReplicas": 5, "reason": "ScaleUp", "message": "m",
        "dryRun": False, "backlogJobs": 20, "backlogTokens": 2000, "time": rfc3339(T0),
        "lastScaleTime": rfc3339(T0),
    }  # fmt: skip


def test_a_change_is_recorded_with_one_event_and_a_repeat_is_not() -> None:
    state = PlannerState({"prefill": RoleState(T0, (), T0)})
    status, events = record((decision(1, 5, p.SCALE_UP),), state, {}, T0)
    assert status is not None and status["prefill"]["desiredReplicas"] == 5
    assert events == (("PlannerScaleUp", "prefill scaled 1 -> 5: m"),)
    again, events = record((decision(1, 5, p.SCALE_UP),), state, status, T0 + 5)
    assert (again, events) == (None, ())


def test_an_unchanged_decision_is_refreshed_after_a_while_without_an_event() -> None:
    steady = (decision(5, 5, p.STEADY),)
    status, _ = record(steady, PlannerState(), {}, T0)
    assert status is not None
    assert record(steady, PlannerState(), status, T0 + RECORD_EVERY_S - 1) == (None, ())
    refreshed, events = record(steady, PlannerState(), status, T0 + RECORD_EVERY_S)
    assert refreshed is not None and events == ()


def test_a_dry_run_change_says_would_scale() -> None:
    _, events = record((decision(1, 5, p.SCALE_UP, dry_run=True),), PlannerState(), {}, T0)
    assert events == (("PlannerScaleUp", "prefill would scale 1 -> 5: m"),)


def test_pool_endpoints_override_the_operators_and_credentials_stay_the_operators() -> None:
    base = Settings(etcd_username="kvrail", nats_user="kvrail")
    plain = pool_settings(base, "ns", "pool")
    assert (plain.namespace, plain.pool, plain.etcd_endpoints) == (
        "ns",
        "pool",
        base.etcd_endpoints,
    )
    infra = InfrastructureSpec.model_validate(
        {"etcd": {"endpoints": ["http://etcd.x:2379"]}, "nats": {"url": "nats://nats.x:4222"}}
    )
    own = pool_settings(base, "ns", "pool", infra)
    assert (own.etcd_endpoints, own.nats_url) == (("http://etcd.x:2379",), "nats://nats.x:4222")
    assert (own.etcd_username, own.nats_user) == ("kvrail", "kvrail")
