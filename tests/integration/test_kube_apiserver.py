"""The real kube-apiserver of the harness: CRDs, custom objects, token auth and RBAC."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvrail.testing.kube import ADMIN, RESTRICTED, KubeControlPlane

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.harness.kvrail.dev"},
    "spec": {
        "group": "harness.kvrail.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": {
                "type": "object",
                "properties": {"size": {"type": "integer", "minimum": 1, "default": 3}},
            }}}},
        }],
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def admin(kube_control_plane: KubeControlPlane) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(str(kube_control_plane.kubeconfig(ADMIN)))
    yield api
    api.close()


@pytest.fixture(scope="module")
def restricted(kube_control_plane: KubeControlPlane) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(str(kube_control_plane.kubeconfig(RESTRICTED)))
    yield api
    api.close()


def _wait_established(ext: client.ApiextensionsV1Api, name: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        crd = ext.read_custom_resource_definition(name)
        conditions = {c.type: c.status for c in (crd.status.conditions or [])}
        if conditions.get("Established") == "True":
            return
        time.sleep(0.2)
    raise AssertionError(f"CRD {name} not Established after {timeout_s}s")


def _allowed(call: Callable[[], object]) -> bool:
    try:
        call()
    except ApiException as err:
        if err.status != 403:
            raise
        return False
    return True


def test_server_reports_the_built_version(admin: client.ApiClient) -> None:
    assert client.VersionApi(admin).get_code().git_version == "v1.36.3"


def test_crd_and_custom_object_are_created_and_read_back(admin: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(admin)
    ext.create_custom_resource_definition(WIDGET_CRD)
    _wait_established(ext, "widgets.harness.kvrail.dev")
    objects = client.CustomObjectsApi(admin)
    body = {"apiVersion": "harness.kvrail.dev/v1", "kind": "Widget",
            "metadata": {"name": "w1"}, "spec": {}}  # fmt: skip
    objects.create_namespaced_custom_object("harness.kvrail.dev", "v1", "default", "widgets", body)
    got = objects.get_namespaced_custom_object(
        "harness.kvrail.dev", "v1", "default", "widgets", "w1"
    )
    assert got["spec"] == {"size": 3}  # the structural schema's default was applied
    bad = {**body, "metadata": {"name": "w2"}, "spec": {"size": 0}}
    with pytest.raises(ApiException) as err:
        objects.create_namespaced_custom_object(
            "harness.kvrail.dev", "v1", "default", "widgets", bad
        )
    assert err.value.status == 422
    assert "spec.size" in err.value.body


def test_restricted_user_is_refused_until_rbac_grants_it(
    admin: client.ApiClient, restricted: client.ApiClient
) -> None:
    core_admin, core_user = client.CoreV1Api(admin), client.CoreV1Api(restricted)
    core_admin.create_namespace({"metadata": {"name": "rbac-test"}})
    with pytest.raises(ApiException) as err:
        core_user.list_namespaced_config_map("rbac-test")
    assert err.value.status == 403
    rbac = client.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role("rbac-test", {
        "metadata": {"name": "read-configmaps"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}],
    })  # fmt: skip
    rbac.create_namespaced_role_binding("rbac-test", {
        "metadata": {"name": "read-configmaps"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "read-configmaps"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": RESTRICTED}],
    })  # fmt: skip
    deadline = time.monotonic() + 10  # the RBAC authorizer's cache catches up within moments
    while not _allowed(lambda: core_user.list_namespaced_config_map("rbac-test")):
        assert time.monotonic() < deadline, "the RoleBinding never took effect"
        time.sleep(0.2)
    for forbidden in (
        lambda: core_user.list_namespaced_config_map("default"),
        lambda: core_user.create_namespaced_config_map("rbac-test", {"metadata": {"name": "x"}}),
        lambda: core_user.list_namespaced_secret("rbac-test"),
        lambda: core_user.list_node(),
    ):
        with pytest.raises(ApiException) as err:
            forbidden()
        assert err.value.status == 403
