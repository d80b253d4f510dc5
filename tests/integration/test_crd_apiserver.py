"""The generated InferencePool CRD on a real kube-apiserver: it is accepted and Established, every
example applies, every invalid manifest of the shared table is refused with a 422 naming the
problem, and kubectl finds the kind by its short name and category with the printer columns.

cel-python (the unit tests) and Kubernetes' CEL differ in functions and cost limits; this is where
the real server has the last word.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvrail.crd.gen import CRD_FILENAME, CRD_NAME
from kvrail.crd.pool import GROUP, PLURAL, VERSION
from kvrail.operator.testing import ACCEPTED as BASE_ACCEPTED
from kvrail.operator.testing import REFUSED as BASE_REFUSED
from kvrail.operator.testing import Change, mutate, pool_manifest
from kvrail.operator.testing_chat import CHAT_ACCEPTED, CHAT_REFUSED, CHAT_SCHEMA_REFUSED
from kvrail.operator.testing_gaie import GAIE_ACCEPTED, GAIE_REFUSED, GAIE_SCHEMA_REFUSED
from kvrail.operator.testing_tiers import TIER_ACCEPTED, TIER_REFUSED
from kvrail.testing.kube import ADMIN, KubeControlPlane

REFUSED = BASE_REFUSED + TIER_REFUSED + CHAT_REFUSED + GAIE_REFUSED
ACCEPTED = BASE_ACCEPTED + TIER_ACCEPTED + CHAT_ACCEPTED + GAIE_ACCEPTED

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
KUBECTL = Path(sys.executable).parent / "kubectl"
NAMESPACE = "crd-test"


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


def wait_established(ext: client.ApiextensionsV1Api, name: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        crd = ext.read_custom_resource_definition(name)
        conditions = {c.type: c.status for c in (crd.status.conditions or [])}
        if conditions.get("Established") == "True":
            return
        assert time.monotonic() < deadline, f"{name} not Established: {conditions}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def objects(kube_control_plane: KubeControlPlane) -> Iterator[client.CustomObjectsApi]:
    """The CRD server-side applied (as kubectl does) and Established; a namespace for tests."""
    kubectl(kube_control_plane, "apply", "--server-side", "-f", str(REPO / "crds" / CRD_FILENAME))
    api = config.new_client_from_config(str(kube_control_plane.kubeconfig(ADMIN)))
    wait_established(client.ApiextensionsV1Api(api), CRD_NAME)
    core = client.CoreV1Api(api)
    for name in (NAMESPACE, "inference"):
        try:
            core.create_namespace({"metadata": {"name": name}})
        except ApiException as err:
            if err.status != 409:
                raise
    yield client.CustomObjectsApi(api)
    api.close()


def create(objects: client.CustomObjectsApi, manifest: dict[str, Any]) -> dict[str, Any]:
    """Create (server dry-run: validation, defaulting and CEL run, nothing is stored)."""
    return objects.create_namespaced_custom_object(  # type: ignore[no-any-return]
        GROUP, VERSION, NAMESPACE, PLURAL, manifest, dry_run="All"
    )


def test_crd_is_established_with_status_and_scale_subresources(
    objects: client.CustomObjectsApi, kube_control_plane: KubeControlPlane
) -> None:
    got = kube_control_plane.api(
        "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"
    )
    version = got["spec"]["versions"][0]
    assert set(version["subresources"]) == {"status", "scale"}
    assert got["spec"]["names"]["shortNames"] == ["kvpool"]


def test_every_example_is_applied_and_defaulted(
    objects: client.CustomObjectsApi, kube_control_plane: KubeControlPlane
) -> None:
    for path in EXAMPLES:
        kubectl(kube_control_plane, "apply", "--server-side", "-f", str(path))
    for path in EXAMPLES:
        manifest = yaml.safe_load(path.read_text())
        namespace = manifest["metadata"].get("namespace", "default")
        got = objects.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, manifest["metadata"]["name"]
        )
        # The structural schema's defaults were applied by the server, not by kubectl.
        assert got["spec"]["decode"]["terminationGracePeriodSeconds"] == 60, path.name
        engine = manifest["spec"].get("engine", {})
        assert got["spec"]["engine"] == {"kind": "kvrail", **engine}, path.name


@pytest.mark.parametrize(("case", "changes", "path", "word"), REFUSED, ids=[c[0] for c in REFUSED])
def test_api_server_refuses_invalid_manifest_naming_the_problem(
    objects: client.CustomObjectsApi, case: str, changes: tuple[Change, ...], path: str, word: str
) -> None:
    with pytest.raises(ApiException) as err:
        create(objects, mutate(pool_manifest(namespace=NAMESPACE), *changes))
    assert err.value.status == 422, err.value.body
    status = yaml.safe_load(err.value.body)
    message = status["message"]
    assert word in message, message
    causes = status["details"]["causes"]
    assert len(causes) == 1, causes
    if path:
        assert causes[0]["field"] == path.lstrip("."), causes


@pytest.mark.parametrize(("case", "changes"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_api_server_accepts_consistent_manifest(
    objects: client.CustomObjectsApi, case: str, changes: tuple[Change, ...]
) -> None:
    create(objects, mutate(pool_manifest(namespace=NAMESPACE), *changes))


def test_schema_refuses_unknown_enum_value_and_out_of_range_number(
    objects: client.CustomObjectsApi,
) -> None:
    base = pool_manifest(namespace=NAMESPACE)
    for changes, field in (
        ((("spec.topology.rdma", "maybe"),), "spec.topology.rdma"),
        ((("spec.model.blockSize", 12),), "spec.model.blockSize"),
        ((("spec.decode.replicas", -1),), "spec.decode.replicas"),
        ((("spec.router.scorers", [{"name": "queue", "weight": 1}]),), "spec.router.scorers"),
        ((("spec.router.scorers", [{"name": "load", "weight": -1}]),), "spec.router.scorers"),
        # KV tier sizes are non-negative byte quantities; the disk path is absolute
        ((("spec.decode.kvTiers", {"host": {"size": "-1Gi"}}),), "spec.decode.kvTiers.host.size"),
        ((("spec.decode.kvTiers", {"host": {"size": "500m"}}),), "spec.decode.kvTiers.host.size"),
        (
            (
                (
                    "spec.decode.kvTiers",
                    {"host": {"size": "1Gi"}, "disk": {"path": "kv", "size": "1Gi"}},
                ),
            ),
            "spec.decode.kvTiers.disk.path",
        ),
        *(((change,), field) for _, change, field in CHAT_SCHEMA_REFUSED),
        *(((change,), field) for _, change, field in GAIE_SCHEMA_REFUSED),
    ):
        with pytest.raises(ApiException) as err:
            create(objects, mutate(base, *changes))
        assert err.value.status == 422
        assert field in err.value.body


def test_kubectl_finds_pools_by_short_name_and_category_with_printer_columns(
    objects: client.CustomObjectsApi, kube_control_plane: KubeControlPlane
) -> None:
    objects.create_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, pool_manifest("columns", NAMESPACE)
    )
    # kubectl asks for a Table: the header comes from additionalPrinterColumns.
    wide = kubectl(kube_control_plane, "get", "kvpool", "-n", NAMESPACE, "-o", "wide")
    header, row = wide.splitlines()[0].split(), wide.splitlines()[1].split()
    assert header == ["NAME", "MODE", "PREFILL", "DECODE", "READY", "MODEL", "ENDPOINT", "AGE"]
    assert row[:2] == ["columns", "disaggregated"]
    assert "smollm2" in row
    by_category = kubectl(kube_control_plane, "get", "kvrail", "-n", NAMESPACE, "-o", "name")
    assert by_category.split() == [f"inferencepool.{GROUP}/columns"]
    by_full_name = kubectl(
        kube_control_plane, "get", f"{PLURAL}.{GROUP}", "-n", NAMESPACE, "-o", "name"
    )
    assert by_full_name == by_category
