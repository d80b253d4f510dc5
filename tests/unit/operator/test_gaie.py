"""GAIE mode's children: the GAIE InferencePool, the endpoint picker, the decode pods' fronts
and the route, as the builders render them; and what reconcile does without GAIE's CRD."""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf
import pytest

from kvrail.crd.pool import InferencePool
from kvrail.operator.apply import InferenceExtensionMissingError, reconcile
from kvrail.operator.builders.children import ChildRef, build_children, stale_children
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.networkpolicy import build_network_policy
from kvrail.operator.handlers import MISSING_CRD_RETRY_DELAY_S, reconcile_inferencepool
from kvrail.operator.k8s import KindNotServedError
from kvrail.operator.testing import COLOCATED, make_pool, mutate, pool_manifest
from kvrail.operator.testing_gaie import gaie
from kvrail.settings import Settings

CTX = BuildContext(image="registry.example/kvrail:test")


class MemoryCluster:
    """`kvrail.operator.apply.Cluster` in memory; `missing` kinds are not served."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.missing: set[str] = set()

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        if manifest["kind"] in self.missing:
            raise KindNotServedError(f"{manifest['kind']}.{manifest['apiVersion']} is not served")
        key = (manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"])
        self.objects[key] = copy.deepcopy(manifest)
        return manifest

    def get(self, api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        return self.objects.get((api_version, kind, name))

    def delete(self, api_version: str, kind: str, name: str, namespace: str) -> bool:
        if kind in self.missing:
            return False
        return self.objects.pop((api_version, kind, name), None) is not None


def pool_with(*changes: tuple[str, Any]) -> InferencePool:
    return make_pool(mutate(pool_manifest(), *changes))


def child(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return found


def containers(statefulset: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in statefulset["spec"]["template"]["spec"]["containers"]}


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_gaie_pool_selects_the_decode_pods_on_the_front_port_picked_by_the_epp() -> None:
    children = build_children(pool_with(gaie(failureMode="FailOpen")), CTX)
    gaie_pool = child(children, "InferencePool", "tiny-gaie")
    assert gaie_pool["apiVersion"] == "inference.networking.k8s.io/v1"
    decode = child(children, "StatefulSet", "tiny-decode")
    pod_labels = decode["spec"]["template"]["metadata"]["labels"]
    selector = gaie_pool["spec"]["selector"]["matchLabels"]
    assert selector == {"kvrail.dev/pool": "tiny", "kvrail.dev/role": "decode"}
    assert selector.items() <= pod_labels.items()
    prefill = child(children, "StatefulSet", "tiny-prefill")
    assert not selector.items() <= prefill["spec"]["template"]["metadata"]["labels"].items()
    front_ports = [p["containerPort"] for p in containers(decode)["front"]["ports"]]
    assert gaie_pool["spec"]["targetPorts"] == [{"number": p} for p in front_ports]
    epp_service = child(children, "Service", "tiny-epp")
    grpc, _metrics = epp_service["spec"]["ports"]
    assert gaie_pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "tiny-epp",
        "port": {"number": grpc["port"]},
        "failureMode": "FailOpen",
    }
    assert "status" not in gaie_pool  # the gateways' to write
    assert gaie_pool["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_a_tls_secret_is_mounted_and_served_by_the_picker() -> None:
    dep = child(
        build_children(pool_with(gaie(tlsSecret="epp-cert")), CTX), "Deployment", "tiny-epp"
    )
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][-2:] == ["--cert-path", "/etc/kvrail/epp-tls"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "epp-tls"]
    assert volume["secret"] == {"secretName": "epp-cert", "defaultMode": 0o440}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "epp-tls"]
    assert mount == {"name": "epp-tls", "mountPath": "/etc/kvrail/epp-tls", "readOnly": True}
    without = child(build_children(pool_with(gaie()), CTX), "Deployment", "tiny-epp")
    assert "--cert-path" not in without["spec"]["template"]["spec"]["containers"][0]["command"]


def test_failure_mode_defaults_to_fail_close() -> None:
    children = build_children(pool_with(gaie()), CTX)
    ref = child(children, "InferencePool", "tiny-gaie")["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"


def test_epp_runs_the_picker_with_the_routers_settings_and_no_api_access() -> None:
    pool = pool_with(gaie(eppReplicas=2, numEndpoints=2,
                          resources={"requests": {"cpu": "500m"}}),
                     ("spec.security.apiKeysSecret", "keys"),
                     ("spec.router.policy", "least-loaded"))  # fmt: skip
    children = build_children(pool, CTX)
    dep = child(children, "Deployment", "tiny-epp")
    router = child(children, "Deployment", "tiny-router")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/kvrail:test"
    assert container["command"] == [
        "python", "-P", "-m", "kvrail.epp", "--port", "9002", "--num-endpoints", "2",
        "--health-port", "9003", "--metrics-port", "9090",
    ]  # fmt: skip
    assert container["resources"] == {"requests": {"cpu": "500m"}}
    router_container = router["spec"]["template"]["spec"]["containers"][0]
    assert env(container) == env(router_container)  # the pool the router follows
    assert env(container)["KVRAIL_ROUTER_POLICY"] == "least-loaded"
    assert env(container)["KVRAIL_API_KEYS_FILE"].endswith("/api-keys.yaml")
    assert container["volumeMounts"] == router_container["volumeMounts"]
    # probes on the plaintext health port: the kubelet's gRPC probes speak no TLS
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    service = child(children, "Service", "tiny-epp")
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"][0]["appProtocol"] == "http2"  # over TLS, as GAIE's pickers
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    # the EPP's metrics, for a ServiceMonitor: the port its command names
    assert [(p["name"], p["targetPort"]) for p in service["spec"]["ports"]][1] == (
        "metrics",
        "metrics",
    )
    assert container["ports"][1:] == [
        {"name": "health", "containerPort": 9003, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9090, "protocol": "TCP"},
    ]


@pytest.mark.parametrize("changes", [(), COLOCATED], ids=["disaggregated", "colocated"])
def test_each_decode_pod_runs_a_front_pinned_to_its_own_worker(changes: Any) -> None:
    children = build_children(pool_with(*changes, gaie()), CTX)
    decode = containers(child(children, "StatefulSet", "tiny-decode"))
    worker, front = decode["worker"], decode["front"]
    # The worker id is the pod's name; the kubelet expands both from the container's own env.
    assert front["command"] == [
        "python", "-P", "-m", "kvrail.router", "--pin-worker", "$(KVRAIL_POD_NAME)",
    ]  # fmt: skip
    assert env(front)["KVRAIL_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert worker["command"][-2:] == ["--http-front", "$(KVRAIL_POD_IP):8000"]
    assert env(worker)["KVRAIL_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env(front)["KVRAIL_HTTP_PORT"] == "8000"
    # The front listens on the pod's own address, IPv4 or IPv6 (0.0.0.0 misses an IPv6 pod);
    # the kubelet expands it from a variable defined before it.
    assert env(front)["KVRAIL_ROUTER_HOST"] == "$(KVRAIL_POD_IP)"
    names = [e["name"] for e in front["env"]]
    assert names.index("KVRAIL_POD_IP") < names.index("KVRAIL_ROUTER_HOST")
    assert names.count("KVRAIL_ROUTER_HOST") == 1
    assert front["ports"] == [{"name": "front", "containerPort": 8000, "protocol": "TCP"}]
    assert front["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "front"}
    pod = child(children, "StatefulSet", "tiny-decode")["spec"]["template"]["spec"]
    names = [v["name"] for v in pod["volumes"]]
    assert len(names) == len(set(names))
    assert {m["name"] for m in front["volumeMounts"]} <= set(names)
    assert {p["containerPort"] for p in worker["ports"]}.isdisjoint({8000})
    if not changes:  # prefill pods are no GAIE endpoints
        prefill = containers(child(children, "StatefulSet", "tiny-prefill"))
        assert list(prefill) == ["worker"]
        assert "--http-front" not in prefill["worker"]["command"]


def test_front_env_is_settings_and_the_network_policy_opens_its_port() -> None:
    pool = pool_with(gaie())
    front = containers(child(build_children(pool, CTX), "StatefulSet", "tiny-decode"))["front"]
    fields = {n.removeprefix("KVRAIL_").lower() for n in env(front) if n.startswith("KVRAIL_")}
    assert fields <= set(Settings.model_fields)
    ingress = build_network_policy(pool)["spec"]["ingress"]
    assert {"ports": [{"protocol": "TCP", "port": 8000}]} in ingress
    assert {"ports": [{"protocol": "TCP", "port": 8000}]} not in build_network_policy(make_pool())[
        "spec"
    ]["ingress"]


def test_route_goes_to_the_gaie_pool_and_the_router_route_is_stale() -> None:
    pool = pool_with(gaie())
    children = build_children(pool, CTX)
    route = child(children, "HTTPRoute", "tiny-gaie")
    assert route["spec"]["parentRefs"][0]["name"] == "gw"
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "tiny-gaie"}
    ]
    assert not [c for c in children if c["kind"] == "HTTPRoute" and c is not route]
    stale = stale_children(pool, CTX)
    assert ChildRef("gateway.networking.k8s.io/v1", "HTTPRoute", "tiny-router") in stale
    one_epp = ChildRef("policy/v1", "PodDisruptionBudget", "tiny-epp")  # one replica: no budget
    assert not [r for r in stale if ("epp" in r.name or "gaie" in r.name) and r != one_epp]
    # The router stays: kvrail's own path keeps working beside the gateway's.
    assert child(children, "Deployment", "tiny-router")


def test_turning_gaie_mode_off_deletes_what_it_made() -> None:
    cluster = MemoryCluster()
    reconcile(cluster, pool_with(gaie()), CTX)
    outcome = reconcile(cluster, pool_with(gaie(enabled=False)), CTX)
    assert sorted(outcome.deleted) == [
        "Deployment/tiny-epp", "HTTPRoute/tiny-gaie", "InferencePool/tiny-gaie", "Service/tiny-epp",
    ]  # fmt: skip
    decode = cluster.get("apps/v1", "StatefulSet", "tiny-decode", "default")
    assert decode is not None
    assert list(containers(decode)) == ["worker"]
    assert "--http-front" not in containers(decode)["worker"]["command"]


def test_missing_gaie_crd_is_reported_as_such_and_leaves_the_old_route() -> None:
    cluster = MemoryCluster()
    reconcile(cluster, pool_with(gaie(enabled=False)), CTX)
    cluster.missing.add("InferencePool")
    with pytest.raises(InferenceExtensionMissingError, match="install the Gateway API Inference"):
        reconcile(cluster, pool_with(gaie()), CTX)
    route = cluster.get("gateway.networking.k8s.io/v1", "HTTPRoute", "tiny-router", "default")
    assert route is not None  # no route to a pool that cannot exist, and no silent switch
    gaie_route = cluster.get("gateway.networking.k8s.io/v1", "HTTPRoute", "tiny-gaie", "default")
    assert gaie_route is None


def test_handler_degrades_the_pool_and_retries_while_gaies_crd_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(kopf, "warn", lambda _, reason, message: events.append((reason, message)))

    manifest = mutate(pool_manifest(), gaie(), ("metadata.uid", "uid-1"))
    body = kopf.Body(manifest)
    patch = kopf.Patch()
    cluster = MemoryCluster()
    cluster.missing.add("InferencePool")
    memo = kopf.Memo(cluster=cluster, ctx=CTX)
    with pytest.raises(kopf.TemporaryError) as err:
        reconcile_inferencepool(body=body, patch=patch, memo=memo, logger=logging.getLogger())
    assert err.value.delay == MISSING_CRD_RETRY_DELAY_S  # installing the CRD is enough
    conditions = {c["type"]: c for c in patch["status"]["conditions"]}
    assert conditions["Degraded"]["status"] == "True"
    assert conditions["Degraded"]["reason"] == "InferenceExtensionMissing"
    assert "inference.networking.k8s.io" in conditions["Degraded"]["message"]
    assert conditions["Ready"]["status"] == "False"
    assert events == [("InferenceExtensionMissing", conditions["Degraded"]["message"])]


@pytest.mark.parametrize(("replicas", "budget"), [(0, False), (1, False), (2, True), (5, True)])
def test_the_epp_gets_a_budget_of_one_eviction_when_it_has_more_than_one_replica(
    replicas: int, budget: bool
) -> None:
    pool = pool_with(gaie(eppReplicas=replicas))
    children = build_children(pool, CTX)
    budgets = [c for c in children if c["kind"] == "PodDisruptionBudget"]
    ref = ChildRef("policy/v1", "PodDisruptionBudget", "tiny-epp")
    if not budget:
        assert "tiny-epp" not in [b["metadata"]["name"] for b in budgets]
        assert ref in stale_children(pool, CTX)  # deleted when the replicas drop to one
        return
    pdb = child(children, "PodDisruptionBudget", "tiny-epp")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    epp = child(children, "Deployment", "tiny-epp")
    assert pdb["spec"]["selector"] == epp["spec"]["selector"]  # the EPP's pods and no others
    router = child(children, "Deployment", "tiny-router")
    assert pdb["spec"]["selector"]["matchLabels"] != router["spec"]["selector"]["matchLabels"]
    assert pdb["metadata"]["ownerReferences"] == epp["metadata"]["ownerReferences"]
    assert ref not in stale_children(pool, CTX)
    # Applied after the Deployment it guards, before the GAIE pool that names the EPP.
    kinds = [(c["kind"], c["metadata"]["name"]) for c in children]
    position = kinds.index(("PodDisruptionBudget", "tiny-epp"))
    assert kinds.index(("Deployment", "tiny-epp")) < position
    assert position < kinds.index(("InferencePool", "tiny-gaie"))


def test_dropping_the_epp_to_one_replica_deletes_its_budget() -> None:
    cluster = MemoryCluster()
    reconcile(cluster, pool_with(gaie(eppReplicas=3)), CTX)
    assert cluster.get("policy/v1", "PodDisruptionBudget", "tiny-epp", "default") is not None
    outcome = reconcile(cluster, pool_with(gaie(eppReplicas=1)), CTX)
    assert outcome.deleted == ["PodDisruptionBudget/tiny-epp"]
    epp = cluster.get("apps/v1", "Deployment", "tiny-epp", "default")
    assert epp is not None and epp["spec"]["replicas"] == 1
