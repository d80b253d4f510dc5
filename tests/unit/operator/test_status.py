"""Pool status computed from observed workloads: conditions, reasons, counts and idempotence."""

from __future__ import annotations

from typing import Any

import pytest

from kvrail.crd.pool import InferencePool
from kvrail.operator import status as st
from kvrail.operator.builders.meta import Component
from kvrail.operator.testing import DELETE, make_pool, mutate, pool_manifest
from kvrail.operator.testing_gaie import gaie

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"
DONE = st.Workload(desired=1, ready=1, updated=1, rolled_out=True)
ROLLING = st.Workload(desired=2, ready=1, updated=1, rolled_out=False)
SHORT = st.Workload(desired=2, ready=1, updated=2, rolled_out=True)
ZERO = st.Workload(desired=0, ready=0, updated=0, rolled_out=True)
ALL_DONE: dict[Component, st.Workload | None] = {"prefill": DONE, "decode": DONE, "router": DONE}


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


CASES: list[tuple[str, dict[str, Any], st.Problem | None, dict[str, tuple[str, str]]]] = [
    ("all rolled out and ready", {}, None, {
        "Ready": ("True", st.ALL_REPLICAS_READY),
        "Progressing": ("False", st.ROLLOUT_COMPLETE),
        "Degraded": ("False", st.AS_EXPECTED),
    }),
    ("a workload not created yet", {"prefill": None}, None, {
        "Ready": ("False", st.WORKLOADS_MISSING),
        "Progressing": ("True", st.ROLLOUT_IN_PROGRESS),
        "Degraded": ("False", st.AS_EXPECTED),
    }),
    ("decode rolling out", {"decode": ROLLING}, None, {
        "Ready": ("False", st.REPLICAS_NOT_READY),
        "Progressing": ("True", st.ROLLOUT_IN_PROGRESS),
        "Degraded": ("False", st.AS_EXPECTED),
    }),
    ("rolled out but a replica is down", {"prefill": SHORT}, None, {
        "Ready": ("False", st.REPLICAS_NOT_READY),
        "Progressing": ("False", st.ROLLOUT_COMPLETE),
        "Degraded": ("True", st.REPLICAS_UNAVAILABLE),
    }),
    ("router scaled to zero", {"router": ZERO}, None, {
        "Ready": ("False", st.NO_SERVING_REPLICAS),
        "Progressing": ("False", st.ROLLOUT_COMPLETE),
        "Degraded": ("False", st.AS_EXPECTED),
    }),
    ("prefill scaled to zero still serves", {"prefill": ZERO}, None, {
        "Ready": ("True", st.ALL_REPLICAS_READY),
        "Progressing": ("False", st.ROLLOUT_COMPLETE),
        "Degraded": ("False", st.AS_EXPECTED),
    }),
    ("invalid spec", {}, st.Problem(st.INVALID_SPEC, "bad"), {
        "Ready": ("False", st.INVALID_SPEC),
        "Progressing": ("False", st.ROLLOUT_COMPLETE),
        "Degraded": ("True", st.INVALID_SPEC),
    }),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "override", "problem", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_conditions_follow_the_observed_workloads(
    case: str,
    override: dict[str, Any],
    problem: st.Problem | None,
    expected: dict[str, tuple[str, str]],
) -> None:
    status = st.compute_status(make_pool(), {**ALL_DONE, **override}, NOW, problem)
    assert conditions(status) == expected


def test_in_gaie_mode_the_endpoint_picker_is_counted_and_awaited() -> None:
    pool = make_pool(mutate(pool_manifest(), gaie(eppReplicas=2)))
    status = st.compute_status(pool, ALL_DONE, NOW)  # no picker Deployment yet
    assert conditions(status)["Ready"] == ("False", st.WORKLOADS_MISSING)
    assert "not created yet: epp" in status["conditions"][0]["message"]
    status = st.compute_status(pool, {**ALL_DONE, "epp": SHORT}, NOW)
    assert conditions(status)["Degraded"] == ("True", st.REPLICAS_UNAVAILABLE)
    assert status["endpointPicker"] == {
        "replicas": 2, "readyReplicas": 1, "updatedReplicas": 2,
        "selector": "kvrail.dev/pool=tiny,kvrail.dev/role=epp",
    }  # fmt: skip
    # scaled to zero (the gateway's failureMode answers): the pool itself still serves
    status = st.compute_status(pool, {**ALL_DONE, "epp": ZERO}, NOW)
    assert conditions(status)["Ready"] == ("True", st.ALL_REPLICAS_READY)
    assert "endpointPicker" not in st.compute_status(make_pool(), ALL_DONE, NOW)  # mode off


def test_colocated_pool_needs_no_prefill_workload() -> None:
    pool = make_pool(
        mutate(pool_manifest(), ("spec.prefill", DELETE), ("spec.disaggregation.mode", "colocated"))
    )
    status = st.compute_status(pool, {"decode": DONE, "router": DONE}, NOW)
    assert conditions(status)["Ready"] == ("True", st.ALL_REPLICAS_READY)
    assert "prefill" not in status


def test_status_carries_generation_counts_selector_endpoint_and_model_hash() -> None:
    pool = make_pool(generation=7)
    status = st.compute_status(pool, {**ALL_DONE, "decode": SHORT}, NOW)
    assert status["observedGeneration"] == 7
    assert {c["observedGeneration"] for c in status["conditions"]} == {7}
    assert status["decode"] == {
        "replicas": 2,
        "readyReplicas": 1,
        "updatedReplicas": 2,
        "selector": "kvrail.dev/pool=tiny,kvrail.dev/role=decode",
    }
    assert status["endpoint"] == "http://tiny-router.default.svc:8000"
    assert len(status["modelHash"]) == 12


def test_endpoint_prefers_the_gateway_hostname() -> None:
    gateway = {"parentRef": {"name": "gw"}, "hostnames": ["llm.example.com"]}
    pool: InferencePool = make_pool(mutate(pool_manifest(), ("spec.router.gateway", gateway)))
    assert st.endpoint(pool) == "http://llm.example.com"


def test_transition_time_is_kept_while_a_condition_holds_its_status() -> None:
    first = st.compute_status(make_pool(), ALL_DONE, NOW)["conditions"]
    second = st.compute_status(make_pool(), {**ALL_DONE, "decode": SHORT}, LATER)["conditions"]
    merged = {c["type"]: c for c in st.keep_transition_times(second, first)}
    assert merged["Ready"]["lastTransitionTime"] == LATER
    assert merged["Progressing"]["lastTransitionTime"] == NOW
    again = st.keep_transition_times(
        st.compute_status(make_pool(), ALL_DONE, LATER)["conditions"], first
    )
    assert again == first


def _sts(**status: Any) -> dict[str, Any]:
    return {
        "kind": "StatefulSet",
        "metadata": {"generation": 2},
        "spec": {"replicas": 2},
        "status": status,
    }


OBSERVED: list[tuple[str, dict[str, Any] | None, st.Workload | None]] = [
    ("absent", None, None),
    ("fresh, no status yet", _sts(), st.Workload(2, 0, 0, False)),
    (
        "old generation observed",
        _sts(observedGeneration=1, updatedReplicas=2, readyReplicas=2),
        st.Workload(2, 2, 2, False),
    ),
    (
        "revisions differ",
        _sts(
            observedGeneration=2,
            updatedReplicas=2,
            readyReplicas=2,
            currentRevision="a",
            updateRevision="b",
        ),
        st.Workload(2, 2, 2, False),
    ),
    (
        "rolled out",
        _sts(
            observedGeneration=2,
            updatedReplicas=2,
            readyReplicas=1,
            currentRevision="b",
            updateRevision="b",
        ),
        st.Workload(2, 1, 2, True),
    ),
]


@pytest.mark.parametrize(("case", "obj", "expected"), OBSERVED, ids=[c[0] for c in OBSERVED])
def test_observe_reads_a_workload_from_the_api_object(
    case: str, obj: dict[str, Any] | None, expected: st.Workload | None
) -> None:
    assert st.observe(obj) == expected


def test_deployment_needs_no_revisions_to_be_rolled_out() -> None:
    dep = {
        "kind": "Deployment",
        "metadata": {"generation": 1},
        "spec": {"replicas": 1},
        "status": {"observedGeneration": 1, "updatedReplicas": 1, "readyReplicas": 1},
    }
    assert st.observe(dep) == st.Workload(1, 1, 1, True)
