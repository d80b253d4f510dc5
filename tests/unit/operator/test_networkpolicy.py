"""The workers' NetworkPolicy: whom it selects, whom it lets in, and the operator's off switch."""

from __future__ import annotations

from typing import Any

import pytest

from kvrail.operator.builders.children import ChildRef, build_children, stale_children
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.meta import (
    POOL_LABEL,
    ROLE_LABEL,
    WORKER_PORT,
    Component,
    labels,
)
from kvrail.operator.builders.networkpolicy import build_network_policy
from kvrail.operator.testing import COLOCATED, VLLM, make_pool, mutate, pool_manifest
from kvrail.settings import load_settings

NETWORK_POLICY = ChildRef("networking.k8s.io/v1", "NetworkPolicy", "tiny-workers")


def selects(selector: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics, for the operators the builder uses."""
    if not selector["matchLabels"].items() <= pod_labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if pod_labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def pod_labels(pool_name: str, role: Component) -> dict[str, str]:
    """The labels the builders put on a pod template of `pool_name`'s `role`."""
    return labels(make_pool(pool_manifest(name=pool_name)), role)


def test_policy_selects_every_worker_of_the_pool_and_no_router() -> None:
    spec = build_network_policy(make_pool())["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert selects(spec["podSelector"], pod_labels("tiny", "prefill"))
    assert selects(spec["podSelector"], pod_labels("tiny", "decode"))
    assert not selects(spec["podSelector"], pod_labels("tiny", "router"))
    assert not selects(spec["podSelector"], pod_labels("other", "decode"))


def test_policy_admits_any_port_only_from_the_pools_own_workers() -> None:
    peers_rule, metrics_rule = build_network_policy(make_pool())["spec"]["ingress"]
    assert "ports" not in peers_rule  # UCX picks its ports at run time
    (peer,) = peers_rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector: the pool's namespace only
    assert selects(peer["podSelector"], pod_labels("tiny", "prefill"))
    assert selects(peer["podSelector"], pod_labels("tiny", "decode"))
    assert not selects(peer["podSelector"], pod_labels("tiny", "router"))
    assert not selects(peer["podSelector"], pod_labels("other", "prefill"))
    assert not selects(peer["podSelector"], {POOL_LABEL: "tiny"})  # in the pool, no worker role
    # The HTTP port (metrics and health, no KV) from any source, and nothing else.
    assert metrics_rule == {"ports": [{"protocol": "TCP", "port": WORKER_PORT}]}


def test_colocated_workers_are_selected_by_their_decode_label() -> None:
    pool = make_pool(mutate(pool_manifest(), *COLOCATED))
    children = build_children(pool, BuildContext())
    (policy,) = [c for c in children if c["kind"] == "NetworkPolicy"]
    (sts,) = [c for c in children if c["kind"] == "StatefulSet"]
    template_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"], template_labels)


def test_policy_selects_the_worker_pod_templates_the_builders_make() -> None:
    children = build_children(make_pool(), BuildContext())
    (policy,) = [c for c in children if c["kind"] == "NetworkPolicy"]
    templates = {
        c["metadata"]["name"]: c["spec"]["template"]["metadata"]["labels"]
        for c in children
        if c["kind"] in ("StatefulSet", "Deployment")
    }
    assert {n for n, t in templates.items() if selects(policy["spec"]["podSelector"], t)} == {
        "tiny-prefill",
        "tiny-decode",
    }
    assert templates["tiny-router"][ROLE_LABEL] == "router"


def test_policy_is_applied_before_any_workload() -> None:
    kinds = [c["kind"] for c in build_children(make_pool(), BuildContext())]
    assert kinds.index("NetworkPolicy") < min(kinds.index("StatefulSet"), kinds.index("Deployment"))


@pytest.mark.parametrize(("enabled", "has_policy"), [(True, True), (False, False)])
def test_operator_setting_turns_the_policy_off_and_makes_it_stale(
    enabled: bool, has_policy: bool
) -> None:
    environ = {"KVRAIL_OPERATOR_NETWORK_POLICIES": str(enabled).lower()}
    ctx = BuildContext(network_policies=load_settings(environ=environ).operator_network_policies)
    pool = make_pool()
    kinds = [c["kind"] for c in build_children(pool, ctx)]
    assert ("NetworkPolicy" in kinds) is has_policy
    assert (NETWORK_POLICY in stale_children(pool, ctx)) is not has_policy


def test_policy_is_on_by_default() -> None:
    assert BuildContext().network_policies
    assert load_settings(environ={}).operator_network_policies


@pytest.mark.parametrize("changes", [VLLM, (*VLLM, *COLOCATED)], ids=["disaggregated", "colocated"])
def test_vllm_pool_also_admits_its_own_routers_on_vllms_port_only(changes: tuple[Any, ...]) -> None:
    pool = make_pool(mutate(pool_manifest(), *changes))
    peers_rule, metrics_rule, router_rule = build_network_policy(pool)["spec"]["ingress"]
    assert peers_rule == build_network_policy(make_pool())["spec"]["ingress"][0]
    assert metrics_rule == {"ports": [{"protocol": "TCP", "port": WORKER_PORT}]}
    assert router_rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    (source,) = router_rule["from"]
    assert set(source) == {"podSelector"}  # no namespaceSelector: the pool's namespace only
    assert selects(source["podSelector"], pod_labels("tiny", "router"))
    assert not selects(source["podSelector"], pod_labels("other", "router"))
    assert not selects(source["podSelector"], pod_labels("tiny", "decode"))
    assert not selects(source["podSelector"], {POOL_LABEL: "tiny"})


def test_kvrail_pool_admits_no_router() -> None:
    for rule in build_network_policy(make_pool())["spec"]["ingress"]:
        for source in rule.get("from", []):
            assert not selects(source["podSelector"], pod_labels("tiny", "router"))


def test_vllm_workers_the_policy_selects_are_the_pods_the_builders_make() -> None:
    children = build_children(make_pool(mutate(pool_manifest(), *VLLM)), BuildContext())
    (policy,) = [c for c in children if c["kind"] == "NetworkPolicy"]
    (router,) = [c for c in children if c["kind"] == "Deployment"]
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["ingress"][2]["from"][0]["podSelector"], router_labels)
    for sts in [c for c in children if c["kind"] == "StatefulSet"]:
        assert selects(policy["spec"]["podSelector"], sts["spec"]["template"]["metadata"]["labels"])
