"""The whole set of children: which exist per mode, their shared invariants, router and route."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.children import ChildRef, build_children, stale_children
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.testing import DELETE, make_pool, mutate, pool_manifest
from kvrail.settings import Settings, load_settings

CTX = BuildContext()
COLOCATED = (("spec.prefill", DELETE), ("spec.disaggregation.mode", "colocated"))
GATEWAY = (
    "spec.router.gateway",
    {"parentRef": {"name": "gw", "namespace": "infra"}, "hostnames": ["llm.example.com"]},
)
ROUTER_CONFIG_MAP = ChildRef("v1", "ConfigMap", "tiny-config")
"""The router's configuration file of earlier operators: never built, always stale."""
GAIE_CHILDREN = [
    ChildRef("v1", "Service", "tiny-epp"),
    ChildRef("apps/v1", "Deployment", "tiny-epp"),
    ChildRef("policy/v1", "PodDisruptionBudget", "tiny-epp"),
    ChildRef("inference.networking.k8s.io/v1", "InferencePool", "tiny-gaie"),
    ChildRef("gateway.networking.k8s.io/v1", "HTTPRoute", "tiny-gaie"),
]
"""What GAIE mode adds: never built without it, so always stale then."""
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def pool_with(*changes: tuple[str, Any]) -> InferencePool:
    return make_pool(mutate(pool_manifest(), *changes))


def kinds(children: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["kind"], c["metadata"]["name"]) for c in children]


def by_kind(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return found


def test_disaggregated_pool_has_both_worker_sets_router_and_budgets() -> None:
    assert kinds(build_children(make_pool(), CTX)) == [
        ("NetworkPolicy", "tiny-workers"),
        ("Service", "tiny-prefill"),
        ("Service", "tiny-decode"),
        ("Service", "tiny-router"),
        ("StatefulSet", "tiny-prefill"),
        ("StatefulSet", "tiny-decode"),
        ("Deployment", "tiny-router"),
        ("PodDisruptionBudget", "tiny-prefill"),
        ("PodDisruptionBudget", "tiny-decode"),
        ("PodDisruptionBudget", "tiny-router"),
    ]


def test_colocated_pool_has_no_prefill_children_and_they_are_stale() -> None:
    pool = pool_with(*COLOCATED)
    assert not [n for _, n in kinds(build_children(pool, CTX)) if "prefill" in n]
    stale = stale_children(pool, CTX)
    assert ChildRef("apps/v1", "StatefulSet", "tiny-prefill") in stale
    assert ChildRef("v1", "Service", "tiny-prefill") in stale
    assert ChildRef("policy/v1", "PodDisruptionBudget", "tiny-prefill") in stale


def test_gateway_adds_an_httproute_to_the_router_service() -> None:
    children = build_children(pool_with(GATEWAY), CTX)
    route = by_kind(children, "HTTPRoute", "tiny-router")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "gw",
            "namespace": "infra",
        }
    ]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "tiny-router", "port": 8000}]
    assert stale_children(pool_with(GATEWAY), CTX) == [ROUTER_CONFIG_MAP, *GAIE_CHILDREN]


@pytest.mark.parametrize(
    "changes", [(), COLOCATED, (GATEWAY,)], ids=["disaggregated", "colocated", "gateway"]
)
def test_every_child_is_owned_labelled_namespaced_and_deterministic(changes: Any) -> None:
    pool = pool_with(*changes)
    children = build_children(pool, CTX)
    assert children == build_children(pool, CTX)
    for child in children:
        meta = child["metadata"]
        assert meta["namespace"] == "default"
        assert meta["labels"]["kvrail.dev/pool"] == "tiny"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvrail-operator"
        assert meta["ownerReferences"][0]["uid"] == "uid-1"
    assert len({(c["kind"], c["metadata"]["name"]) for c in children}) == len(children)


def test_longest_allowed_pool_name_gives_valid_child_names() -> None:
    name = "p" * 40
    pool = make_pool(mutate(pool_manifest(name=name), (GATEWAY)))
    for child in build_children(pool, CTX):
        assert DNS_LABEL.match(child["metadata"]["name"]), child["metadata"]["name"]
        assert len(child["metadata"]["name"]) <= 52  # StatefulSet revision labels need 11 more


def test_every_kvrail_variable_is_a_settings_field_or_known_pending() -> None:
    pool = pool_with(
        (
            "spec.infrastructure.etcd",
            {"endpoints": ["https://e:2379"], "credentialsSecret": "a", "caSecret": "b"},
        ),
        (
            "spec.infrastructure.nats",
            {"url": "tls://n:4222", "credentialsSecret": "c", "caSecret": "d"},
        ),
        ("spec.model.revision", "r1"),
        ("spec.model.servedName", "m"),
        ("spec.security.apiKeysSecret", "keys"),
    )
    names = set()
    for child in build_children(pool, CTX):
        if child["kind"] in ("StatefulSet", "Deployment"):
            for container in child["spec"]["template"]["spec"]["containers"]:
                names |= {e["name"] for e in container["env"] if e["name"].startswith("KVRAIL_")}
    fields = {n.removeprefix("KVRAIL_").lower() for n in names}
    unknown = fields - set(Settings.model_fields)
    assert not unknown, f"kvrail.settings refuses these at start: {sorted(unknown)}"


def test_router_takes_its_settings_from_its_environment_alone() -> None:
    def router(pool: InferencePool) -> dict[str, Any]:
        return by_kind(build_children(pool, CTX), "Deployment", "tiny-router")

    dep = router(pool_with(("spec.router.replicas", 2), ("spec.router.policy", "round-robin")))
    template = dep["spec"]["template"]
    container = template["spec"]["containers"][0]
    assert container["command"] == ["python", "-P", "-m", "kvrail.router"]
    assert dep["spec"]["replicas"] == 2
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVRAIL_ROUTER_POLICY"] == "round-robin"
    assert env["KVRAIL_BLOCK_SIZE"] == "16"
    assert env["KVRAIL_MAX_MODEL_LEN"] == "4096"
    assert env["KVRAIL_MIN_REMOTE_PREFILL_TOKENS"] == "512"
    assert not [v for v in template["spec"]["volumes"] if "configMap" in v]
    assert "annotations" not in template["metadata"]


def test_router_scorers_reach_the_router_through_its_settings() -> None:
    def router_environ(pool: InferencePool) -> dict[str, str]:
        dep = by_kind(build_children(pool, CTX), "Deployment", "tiny-router")
        env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
        return {e["name"]: e["value"] for e in env if "value" in e}

    assert "KVRAIL_ROUTER_SCORERS" not in router_environ(make_pool())
    assert load_settings(environ=router_environ(make_pool())).router_scorers == ()
    scorers = [{"name": "prefix-cache", "weight": 2}, {"name": "load", "weight": 40}]
    environ = router_environ(pool_with(("spec.router.scorers", scorers)))
    assert environ["KVRAIL_ROUTER_SCORERS"] == "prefix-cache=2,load=40"
    settings = load_settings(environ=environ)
    assert [s.model_dump() for s in settings.router_scorers] == scorers


def test_the_router_config_map_of_earlier_operators_is_stale() -> None:
    assert "ConfigMap" not in {c["kind"] for c in build_children(make_pool(), CTX)}
    assert ROUTER_CONFIG_MAP in stale_children(make_pool(), CTX)


def test_api_keys_secret_is_mounted_in_the_router_only() -> None:
    children = build_children(pool_with(("spec.security.apiKeysSecret", "keys")), CTX)
    router = by_kind(children, "Deployment", "tiny-router")["spec"]["template"]["spec"]
    assert any(v.get("secret", {}).get("secretName") == "keys" for v in router["volumes"])
    decode = by_kind(children, "StatefulSet", "tiny-decode")["spec"]["template"]["spec"]
    assert not any(v.get("secret", {}).get("secretName") == "keys" for v in decode["volumes"])


def test_budgets_allow_one_disruption_per_role() -> None:
    for child in build_children(make_pool(), CTX):
        if child["kind"] == "PodDisruptionBudget":
            assert child["spec"]["maxUnavailable"] == 1
            assert child["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_worker_services_are_headless_and_the_router_service_has_the_spec_type() -> None:
    children = build_children(pool_with(("spec.router.serviceType", "LoadBalancer")), CTX)
    assert by_kind(children, "Service", "tiny-decode")["spec"]["clusterIP"] == "None"
    assert by_kind(children, "Service", "tiny-router")["spec"]["type"] == "LoadBalancer"
