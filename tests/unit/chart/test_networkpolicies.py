"""The chart's NetworkPolicies (`templates/networkpolicies/`) and its `networkPolicies` value.

The in-cluster etcd and NATS must admit every pod that talks to them (the release's own pods,
the pools' routers and workers as the operator's builders label them) and nothing else; the
operator's own per-pool policy is switched with the same value.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvrail.operator.builders.children import build_children
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.testing import make_pool, pool_manifest
from kvrail.settings import load_settings

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "kvrail"
RELEASE, NAMESPACE = "kvrail", "kvrail-system"
CLIENT_PORTS = {"etcd": 2379, "nats": 4222}


def render(helm_binary: Path, *values: str) -> list[dict[str, Any]]:
    sets = [a for v in values for a in ("--set", v)]
    done = subprocess.run(
        [str(helm_binary), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--kube-version", "1.36", *sets],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}


def pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """`<kind>/<name>` to the labels of the pods it makes (a Pod's own labels)."""
    out = {}
    for d in docs:
        key = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] == "Pod":
            out[key] = d["metadata"]["labels"]
        elif d["kind"] in ("Deployment", "StatefulSet", "Job"):
            out[key] = d["spec"]["template"]["metadata"]["labels"]
    return out


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] == "Exists" and expr["key"] not in labels:
            return False
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
        assert expr["operator"] in ("Exists", "In"), expr
    return True


def admits(policy: dict[str, Any], labels: dict[str, str], namespace: str, port: int) -> bool:
    """Whether `policy` lets a pod with `labels` in `namespace` connect on TCP `port`."""
    for rule in policy["spec"]["ingress"]:
        if "ports" in rule and {"protocol": "TCP", "port": port} not in rule["ports"]:
            continue
        for peer in rule.get("from", [{}]):
            namespaces = peer.get("namespaceSelector")
            if namespaces is None:
                in_namespace = namespace == policy["metadata"]["namespace"]
            else:
                in_namespace = selects(namespaces, {"kubernetes.io/metadata.name": namespace})
            if in_namespace and selects(peer.get("podSelector", {}), labels):
                return True
    return False


def pool_pod_labels(namespace: str) -> list[dict[str, str]]:
    """The pod template labels the operator gives a pool's workers and router."""
    pool = make_pool(pool_manifest(namespace=namespace))
    return [
        c["spec"]["template"]["metadata"]["labels"]
        for c in build_children(pool, BuildContext())
        if c["kind"] in ("StatefulSet", "Deployment")
    ]


@pytest.mark.helm
def test_etcd_and_nats_admit_the_releases_pods_and_every_pools_pods(helm_binary: Path) -> None:
    docs = render(helm_binary)
    found = policies(docs)
    assert set(found) == {f"{RELEASE}-etcd", f"{RELEASE}-nats"}
    pods = pod_labels(docs)
    clients = {f"Deployment/{RELEASE}-operator", f"Job/{RELEASE}-etcd-auth", f"Pod/{RELEASE}-test"}
    assert clients <= set(pods)
    for server, port in CLIENT_PORTS.items():
        policy = found[f"{RELEASE}-{server}"]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        # It selects the server's pods and no other pod of the chart.
        selected = [k for k, v in pods.items() if selects(policy["spec"]["podSelector"], v)]
        assert selected == [f"StatefulSet/{RELEASE}-{server}"]
        # The operator, the etcd auth Job and `helm test` reach it ...
        for name, labels in pods.items():
            assert admits(policy, labels, NAMESPACE, port), (server, name)
        # ... and so do the routers and workers of a pool in any namespace, on the client port.
        for labels in pool_pod_labels("team-a"):
            assert admits(policy, labels, "team-a", port), (server, labels)
            assert not admits(policy, labels, "team-a", port + 1), (server, labels)
        # A pod that is not kvrail's does not, in the release's namespace or any other.
        for namespace in (NAMESPACE, "team-a"):
            assert not admits(policy, {"app": "other"}, namespace, port)
            assert not admits(policy, {"app.kubernetes.io/part-of": "kvrail"}, namespace, port)


@pytest.mark.helm
def test_watch_namespaces_limit_the_pools_that_reach_etcd_and_nats(helm_binary: Path) -> None:
    found = policies(render(helm_binary, "operator.watchNamespaces={team-a,team-b}"))
    for server, port in CLIENT_PORTS.items():
        policy = found[f"{RELEASE}-{server}"]
        for namespace, admitted in (("team-a", True), ("team-b", True), ("team-c", False)):
            for labels in pool_pod_labels(namespace):
                assert admits(policy, labels, namespace, port) is admitted, (server, namespace)


@pytest.mark.helm
@pytest.mark.parametrize(
    ("values", "expected", "operator_policies"),
    [
        ((), {"etcd", "nats"}, True),
        (("networkPolicies.enabled=false",), set(), False),
        (("etcd.enabled=false", "etcd.endpoints={http://etcd.example:2379}"), {"nats"}, True),
        (("nats.enabled=false", "nats.url=nats://nats.example:4222"), {"etcd"}, True),
    ],
    ids=["default", "disabled", "external-etcd", "external-nats"],
)
def test_policies_exist_for_in_cluster_servers_and_follow_the_switch(
    helm_binary: Path, values: tuple[str, ...], expected: set[str], operator_policies: bool
) -> None:
    docs = render(helm_binary, *values)
    assert set(policies(docs)) == {f"{RELEASE}-{s}" for s in expected}
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    settings = load_settings(environ=env)
    assert settings.operator_network_policies is operator_policies


@pytest.mark.helm
@pytest.mark.parametrize("values", [(), ("networkPolicies.enabled=false",)], ids=["on", "off"])
def test_operator_may_create_patch_and_delete_network_policies_and_nothing_more(
    helm_binary: Path, values: tuple[str, ...]
) -> None:
    docs = render(helm_binary, *values)
    verbs = [
        sorted(rule["verbs"])
        for d in docs
        if d["kind"] == "ClusterRole"
        for rule in d["rules"]
        if "networkpolicies" in rule["resources"]
    ]
    # Also when off: the operator deletes the policies it made before.
    assert verbs == [["create", "delete", "patch"]]


@pytest.mark.parametrize(
    ("value", "error"),
    [({"enabled": "yes"}, "is not of type 'boolean'"), ({"egress": True}, "Additional properties")],
)
def test_schema_refuses_wrong_network_policies_values(value: dict[str, Any], error: str) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["networkPolicies"] == {"enabled": True}
    jsonschema.validate(values, schema)
    with pytest.raises(jsonschema.ValidationError, match=error):
        jsonschema.validate({**values, "networkPolicies": value}, schema)
