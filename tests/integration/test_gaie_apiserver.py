"""GAIE mode on a real kube-apiserver: kvrail's InferencePool CRD beside the Gateway API
Inference Extension's (GAIE v1.6.0, from its Go module), the operator's own reconcile through
its real API client, and kubectl addressing each kind unambiguously.

It checks that, with GAIE mode on, reconcile refuses to go on while GAIE's CRD is absent (a
clear error, no silent fallback to the router route), and that once the CRD is installed every
child the operator renders is accepted: the GAIE InferencePool, the endpoint picker, the decode
pods' fronts and the HTTPRoute to the GAIE pool. A gateway's `status.parents` survives the next
reconcile, because the operator never writes the GAIE pool's status.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvrail.crd.gen import CRD_FILENAME, CRD_NAME
from kvrail.crd.pool import GROUP, PLURAL, VERSION, InferencePool
from kvrail.operator.apply import InferenceExtensionMissingError, reconcile
from kvrail.operator.builders.children import build_children
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.k8s import Kube
from kvrail.operator.testing import COLOCATED, make_pool, mutate, pool_manifest
from kvrail.operator.testing_gaie import gaie
from kvrail.testing.kube import ADMIN, KubeControlPlane

REPO = Path(__file__).resolve().parents[2]
KUBECTL = Path(sys.executable).parent / "kubectl"
NAMESPACE = "gaie-test"
GAIE_GROUP = "inference.networking.k8s.io"
GAIE_CRD = f"inferencepools.{GAIE_GROUP}"
CTX = BuildContext()


def kubectl(plane: KubeControlPlane, *args: str) -> str:
    """Run kubectl as the admin; return stdout, fail with stderr."""
    done = subprocess.run(
        [str(KUBECTL), f"--kubeconfig={plane.kubeconfig(ADMIN)}", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def wait_crd(
    ext: client.ApiextensionsV1Api, name: str, present: bool, timeout_s: float = 60
) -> None:
    """Until the CRD is Established (`present`) or gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            crd = ext.read_custom_resource_definition(name)
            conditions = {c.type: c.status for c in (crd.status.conditions or [])}
            if present and conditions.get("Established") == "True":
                return
        except ApiException as err:
            if err.status != 404:
                raise
            if not present:
                return
        assert time.monotonic() < deadline, f"{name} not {'Established' if present else 'gone'}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def api(kube_control_plane: KubeControlPlane, gateway_api_crds: Path) -> Iterator[client.ApiClient]:
    """kvrail's CRD and Gateway API's HTTPRoute CRD, Established; a namespace for the tests."""
    kubectl(kube_control_plane, "apply", "--server-side", "-f", str(REPO / "crds" / CRD_FILENAME))
    routes = gateway_api_crds / "gateway.networking.k8s.io_httproutes.yaml"
    kubectl(kube_control_plane, "apply", "--server-side", "-f", str(routes))
    admin = config.new_client_from_config(str(kube_control_plane.kubeconfig(ADMIN)))
    ext = client.ApiextensionsV1Api(admin)
    wait_crd(ext, CRD_NAME, present=True)
    wait_crd(ext, "httproutes.gateway.networking.k8s.io", present=True)
    try:
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": NAMESPACE}})
    except ApiException as err:
        if err.status != 409:
            raise
    yield admin
    # Leave no pool for an operator that a later test of the session runs on every namespace.
    objects = client.CustomObjectsApi(admin)
    for name in ("chat", "solo"):
        try:
            objects.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
        except ApiException as err:
            if err.status != 404:
                raise
    admin.close()


def install_gaie(plane: KubeControlPlane, admin: client.ApiClient, crd: Path) -> None:
    kubectl(plane, "apply", "--server-side", "-f", str(crd))
    wait_crd(client.ApiextensionsV1Api(admin), GAIE_CRD, present=True)


def created_pool(admin: client.ApiClient, name: str, *changes: tuple[str, Any]) -> InferencePool:
    """A kvrail pool created on the server (its uid owns the children), as the operator parses
    it."""
    objects = client.CustomObjectsApi(admin)
    manifest = mutate(pool_manifest(name, NAMESPACE), *changes)
    try:
        body = objects.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, manifest)
    except ApiException as err:
        if err.status != 409:
            raise
        body = objects.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
    return make_pool(
        {**manifest, "spec": body["spec"]},
        uid=body["metadata"]["uid"],
        generation=body["metadata"]["generation"],
    )


def get_gaie_pool(admin: client.ApiClient, name: str) -> dict[str, Any]:
    objects = client.CustomObjectsApi(admin)
    return objects.get_namespaced_custom_object(  # type: ignore[no-any-return]
        GAIE_GROUP, "v1", NAMESPACE, "inferencepools", name
    )


def test_gaie_mode_waits_for_gaies_crd_then_every_child_is_accepted(
    api: client.ApiClient, kube_control_plane: KubeControlPlane, gaie_crd: Path
) -> None:
    ext = client.ApiextensionsV1Api(api)
    # A discovery that saw GAIE's kind, kept in the dynamic client's cache file (shared by every
    # process that talks to this API server, as an operator run by an earlier test): the
    # operator must notice the kind is gone once its CRD is deleted, not apply into a 404.
    install_gaie(kube_control_plane, api, gaie_crd)
    assert Kube(api).get(f"{GAIE_GROUP}/v1", "InferencePool", "none", NAMESPACE) is None
    try:
        ext.delete_custom_resource_definition(GAIE_CRD)
    except ApiException as err:
        if err.status != 404:
            raise
    wait_crd(ext, GAIE_CRD, present=False)
    pool = created_pool(api, "chat", gaie(failureMode="FailOpen", eppReplicas=2))
    with pytest.raises(InferenceExtensionMissingError, match=GAIE_GROUP):
        reconcile(Kube(api), pool, CTX)
    routes = client.CustomObjectsApi(api).list_namespaced_custom_object(
        "gateway.networking.k8s.io", "v1", NAMESPACE, "httproutes"
    )
    assert routes["items"] == []  # no route to a GAIE pool that cannot exist

    install_gaie(kube_control_plane, api, gaie_crd)
    outcome = reconcile(Kube(api), pool, CTX)  # a new client: discovery sees the new kind
    assert outcome.applied == len(build_children(pool, CTX))
    gaie_pool = get_gaie_pool(api, "chat-gaie")
    assert gaie_pool["spec"]["selector"]["matchLabels"] == {
        "kvrail.dev/pool": "chat",
        "kvrail.dev/role": "decode",
    }
    assert gaie_pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert gaie_pool["spec"]["endpointPickerRef"]["name"] == "chat-epp"
    assert gaie_pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert gaie_pool["metadata"]["ownerReferences"][0]["uid"] == pool.metadata.uid
    route = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "gateway.networking.k8s.io", "v1", NAMESPACE, "httproutes", "chat-gaie"
    )
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    apps = client.AppsV1Api(api)
    assert apps.read_namespaced_deployment("chat-epp", NAMESPACE).spec.replicas == 2
    budget = client.PolicyV1Api(api).read_namespaced_pod_disruption_budget("chat-epp", NAMESPACE)
    assert budget.spec.max_unavailable == 1  # two pickers: a drain evicts one at a time
    epp_pods = {"kvrail.dev/pool": "chat", "kvrail.dev/role": "epp"}
    assert budget.spec.selector.match_labels == epp_pods
    decode = apps.read_namespaced_stateful_set("chat-decode", NAMESPACE)
    assert [c.name for c in decode.spec.template.spec.containers] == ["worker", "front"]

    # A gateway reports on the GAIE pool; the operator's next apply leaves that alone.
    parents = [
        {
            "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"},
            "controllerName": "example.com/gateway",
            "conditions": [
                {
                    "type": "Accepted",
                    "status": "True",
                    "reason": "Accepted",
                    "message": "",
                    "lastTransitionTime": "2026-12-06T00:00:00Z",
                    "observedGeneration": 1,
                }
            ],
        }
    ]
    client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        GAIE_GROUP, "v1", NAMESPACE, "inferencepools", "chat-gaie", {"status": {"parents": parents}}
    )
    reconcile(Kube(api), pool, CTX)
    assert get_gaie_pool(api, "chat-gaie")["status"]["parents"] == parents


def test_kubectl_addresses_each_inferencepool_kind_unambiguously(
    api: client.ApiClient, kube_control_plane: KubeControlPlane, gaie_crd: Path
) -> None:
    install_gaie(kube_control_plane, api, gaie_crd)
    pool = created_pool(api, "solo", *COLOCATED, gaie())
    reconcile(Kube(api), pool, CTX)

    def names(resource: str) -> set[str]:
        out = kubectl(kube_control_plane, "get", resource, "-n", NAMESPACE, "-o", "name")
        return set(out.split())

    kvrail_pools = names("kvpool")
    assert f"inferencepool.{GROUP}/solo" in kvrail_pools
    assert all(n.startswith(f"inferencepool.{GROUP}/") for n in kvrail_pools)
    assert names(f"{PLURAL}.{GROUP}") == kvrail_pools
    gaie_pools = names(GAIE_CRD)
    assert f"inferencepool.{GAIE_GROUP}/solo-gaie" in gaie_pools
    assert all(n.startswith(f"inferencepool.{GAIE_GROUP}/") for n in gaie_pools)
    assert names("infpool") == gaie_pools  # GAIE's own short name
    # The bare plural names one of the two kinds, never both: the docs say to qualify it.
    bare = names("inferencepools")
    assert bare in (kvrail_pools, gaie_pools), bare
    resources = kubectl(kube_control_plane, "api-resources", "--api-group", GAIE_GROUP)
    assert "inferencepools" in resources and "kvpool" not in resources
