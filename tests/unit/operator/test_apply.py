"""Reconciling a pool against an in-memory cluster: idempotence, stale children, error sorting.

The real API server is exercised by the cluster tests; this stand-in implements only
`kvrail.operator.apply.Cluster` (our interface), to check what reconcile asks of it.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import kopf
import pytest
from kubernetes.dynamic.exceptions import DynamicApiError

from kvrail.operator.apply import ApplyRefusedError, observe_workloads, reconcile
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.k8s import KindNotServedError
from kvrail.operator.testing import DELETE, make_pool, mutate, pool_manifest

CTX = BuildContext()
Key = tuple[str, str, str, str]


class MemoryCluster:
    def __init__(self, fail_kind: str | None = None, error: Exception | None = None) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.fail_kind, self.error = fail_kind, error

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        if manifest["kind"] == self.fail_kind and self.error is not None:
            raise self.error
        meta = manifest["metadata"]
        key = (manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        self.objects[key] = copy.deepcopy(manifest)
        return manifest

    def get(self, api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        return self.objects.get((api_version, kind, namespace, name))

    def delete(self, api_version: str, kind: str, name: str, namespace: str) -> bool:
        return self.objects.pop((api_version, kind, namespace, name), None) is not None


def api_error(status: int) -> DynamicApiError:
    return DynamicApiError(SimpleNamespace(status=status, reason="r", body=None, headers=None))


def test_second_reconcile_changes_nothing() -> None:
    cluster = MemoryCluster()
    first = reconcile(cluster, make_pool(), CTX)
    snapshot = copy.deepcopy(cluster.objects)
    second = reconcile(cluster, make_pool(), CTX)
    assert cluster.objects == snapshot
    assert first.applied == second.applied == len(snapshot)
    assert second.deleted == []


def test_switch_to_colocated_deletes_the_prefill_children() -> None:
    cluster = MemoryCluster()
    reconcile(cluster, make_pool(), CTX)
    colocated = mutate(
        pool_manifest(), ("spec.prefill", DELETE), ("spec.disaggregation.mode", "colocated")
    )
    outcome = reconcile(cluster, make_pool(colocated), CTX)
    assert sorted(outcome.deleted) == [
        "PodDisruptionBudget/tiny-prefill",
        "Service/tiny-prefill",
        "StatefulSet/tiny-prefill",
    ]
    assert not [k for k in cluster.objects if k[3] == "tiny-prefill"]


@pytest.mark.parametrize("status", [400, 403, 422])
def test_refused_child_is_a_permanent_failure(status: int) -> None:
    cluster = MemoryCluster("StatefulSet", api_error(status))
    with pytest.raises(ApplyRefusedError, match=f"StatefulSet tiny-prefill refused \\({status}\\)"):
        reconcile(cluster, make_pool(), CTX)


def test_missing_gateway_api_is_a_permanent_failure() -> None:
    gateway = {"parentRef": {"name": "gw"}}
    cluster = MemoryCluster("HTTPRoute", KindNotServedError("HTTPRoute is not served"))
    with pytest.raises(ApplyRefusedError, match="HTTPRoute"):
        reconcile(
            cluster, make_pool(mutate(pool_manifest(), ("spec.router.gateway", gateway))), CTX
        )


@pytest.mark.parametrize("status", [409, 429, 500, 503])
def test_transient_api_errors_propagate_for_a_retry(status: int) -> None:
    with pytest.raises(DynamicApiError):
        reconcile(MemoryCluster("Deployment", api_error(status)), make_pool(), CTX)


def test_observe_workloads_reads_the_pools_statefulsets_and_deployment() -> None:
    cluster = MemoryCluster()
    assert observe_workloads(cluster, make_pool()) == {
        "prefill": None,
        "decode": None,
        "router": None,
        "epp": None,
    }
    reconcile(cluster, make_pool(), CTX)
    observed = observe_workloads(cluster, make_pool())
    assert observed["decode"] is not None
    assert observed["decode"].desired == 1
    assert observed["decode"].rolled_out is False


def test_handlers_are_registered_with_stable_ids() -> None:
    import kvrail.operator.main  # noqa: F401  (registers the handlers)

    registry = kopf.get_default_registry()
    changing = {h.id for h in registry._changing.get_all_handlers()}
    assert {"create-inferencepool", "resume-inferencepool", "update-inferencepool/spec"} <= changing
    assert "observe-inferencepool" in {h.id for h in registry._spawning.get_all_handlers()}
    assert "configure-operator" in {h.id for h in registry._activities.get_all_handlers()}


AUTOSCALED = (
    ("spec.autoscaling.enabled", True),
    ("spec.prefill.replicas", 2),
    ("spec.prefill.maxReplicas", 6),
    ("spec.decode.maxReplicas", 4),
)


def replicas(cluster: MemoryCluster, role: str) -> int:
    sts = cluster.get("apps/v1", "StatefulSet", f"tiny-{role}", "default")
    assert sts is not None
    return int(sts["spec"]["replicas"])


def scale(cluster: MemoryCluster, role: str, size: int) -> None:
    """What the planner does through the scale subresource."""
    sts = cluster.get("apps/v1", "StatefulSet", f"tiny-{role}", "default")
    assert sts is not None
    sts["spec"]["replicas"] = size


def test_a_spec_edit_keeps_the_planners_sizes_while_it_is_in_charge() -> None:
    cluster = MemoryCluster()
    reconcile(cluster, make_pool(mutate(pool_manifest(), *AUTOSCALED)), CTX)
    assert (replicas(cluster, "prefill"), replicas(cluster, "decode")) == (2, 1)
    scale(cluster, "prefill", 5)
    scale(cluster, "decode", 3)
    edited = mutate(pool_manifest(), *AUTOSCALED, ("spec.model.revision", "r2"))
    reconcile(cluster, make_pool(edited, generation=2), CTX)
    assert (replicas(cluster, "prefill"), replicas(cluster, "decode")) == (5, 3)


def test_new_bounds_clamp_the_planners_size_at_once() -> None:
    cluster = MemoryCluster()
    reconcile(cluster, make_pool(mutate(pool_manifest(), *AUTOSCALED)), CTX)
    scale(cluster, "prefill", 6)
    narrower = mutate(pool_manifest(), *AUTOSCALED, ("spec.prefill.maxReplicas", 3))
    reconcile(cluster, make_pool(narrower, generation=2), CTX)
    assert replicas(cluster, "prefill") == 3


@pytest.mark.parametrize(
    "switch",
    [("spec.autoscaling.enabled", False), ("spec.autoscaling.dryRun", True)],
)
def test_without_the_planner_in_charge_the_spec_sets_the_size(switch: tuple[str, Any]) -> None:
    cluster = MemoryCluster()
    reconcile(cluster, make_pool(mutate(pool_manifest(), *AUTOSCALED)), CTX)
    scale(cluster, "prefill", 5)
    reconcile(cluster, make_pool(mutate(pool_manifest(), *AUTOSCALED, switch), generation=2), CTX)
    assert replicas(cluster, "prefill") == 2
