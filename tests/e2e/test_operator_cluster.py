"""The operator on the full harness: kube-apiserver, controller-manager, scheduler and KWOK nodes.

It runs as a subprocess (`kopf run --standalone -m kvrail.operator.main`) under the Helm chart's
RBAC with its own ServiceAccount token, never as admin. The tests apply the examples and check
the children, where the real scheduler puts the pods, status, scaling, a model change, a child the
API server refuses, deletion through the garbage collector and the finalizer (the pool's etcd keys
and JetStream stream on the harness's real servers), a vLLM pool's workers, and what the token
may not do.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvrail.bus import PrefillQueue, connect
from kvrail.crd.pool import GROUP, PLURAL, VERSION
from kvrail.keys import PoolKeys
from kvrail.local.procs import ManagedProcess
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import PrefillJob
from kvrail.operator.builders.meta import MODEL_HASH_LABEL, POOL_LABEL, ROLE_LABEL
from kvrail.operator.testing import mutate
from kvrail.registry import etcd_client
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings
from kvrail.testing.cluster_checks import pool_traces
from kvrail.testing.kube import ADMIN, KubeControlPlane
from kvrail.testing.operator_process import (
    OPERATOR_NAMESPACE,
    REPO,
    launch_operator,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.helm]

KUBECTL = Path(sys.executable).parent / "kubectl"
NAMESPACE = "kvrail-e2e"
RDMA_NAMESPACE = "inference"  # examples/gpu-8b-rdma.yaml names it
RDMA_LABEL = "feature.node.kubernetes.io/rdma.capable"
RACK_LABEL = "example.com/rack"  # the RDMA example's colocationKey
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
RDMA_NODES = {"e2e-rdma-a0": "rack-a", "e2e-rdma-a1": "rack-a",
              "e2e-rdma-b0": "rack-b", "e2e-rdma-b1": "rack-b"}  # fmt: skip
PLAIN_NODE = "e2e-plain-a2"  # GPUs, rack-a, but no RDMA
CHILD_KINDS = ("configmaps", "services", "statefulsets", "deployments", "poddisruptionbudgets",
               "networkpolicies")  # fmt: skip
DEADLINE_S = 90


@dataclass
class Env:
    plane: KubeControlPlane
    admin: client.ApiClient
    operator_api: client.ApiClient
    operator: ManagedProcess
    servers: Settings | None = None
    """The harness's etcd and NATS, the operator's default endpoints."""

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        done = subprocess.run(
            [str(KUBECTL), f"--kubeconfig={self.plane.kubeconfig(ADMIN)}", *args],
            input=stdin, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    def pool(self, namespace: str, name: str) -> dict[str, Any]:
        return client.CustomObjectsApi(self.admin).get_namespaced_custom_object(  # type: ignore[no-any-return]
            GROUP, VERSION, namespace, PLURAL, name
        )

    def patch_pool(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        client.CustomObjectsApi(self.admin).patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, patch
        )

    def children(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        """Every object labelled as the pool's, of the kinds the operator creates."""
        selector = f"{POOL_LABEL}={pool}"
        out = []
        for kind in CHILD_KINDS:
            group = {"statefulsets": "apps/v1", "deployments": "apps/v1",
                     "poddisruptionbudgets": "policy/v1",
                     "networkpolicies": "networking.k8s.io/v1"}.get(kind)  # fmt: skip
            prefix = f"/apis/{group}" if group else "/api/v1"
            got = self.plane.api(
                "GET", f"{prefix}/namespaces/{namespace}/{kind}?labelSelector={selector}"
            )
            out += got["items"]
        routes = client.CustomObjectsApi(self.admin).list_namespaced_custom_object(
            "gateway.networking.k8s.io", "v1", namespace, "httproutes", label_selector=selector
        )
        return out + routes["items"]

    def pods(self, namespace: str, selector: str) -> list[client.V1Pod]:
        return (
            client.CoreV1Api(self.admin)
            .list_namespaced_pod(  # type: ignore[no-any-return]
                namespace, label_selector=selector
            )
            .items
        )


def condition(pool: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [c for c in pool.get("status", {}).get("conditions", []) if c["type"] == kind]
    return found[0] if found else {}


def ready_at(env: Env, namespace: str, name: str) -> dict[str, Any] | None:
    """The pool when Ready is True for its current generation, else None."""
    pool = env.pool(namespace, name)
    ready = condition(pool, "Ready")
    generation = pool["metadata"]["generation"]
    if ready.get("status") == "True" and ready.get("observedGeneration") == generation:
        return pool if pool["status"]["observedGeneration"] == generation else None
    return None


def label_selector(selector: client.V1LabelSelector) -> str:
    """A LabelSelector as a `labelSelector` query (the In operator only)."""
    terms = [f"{k}={v}" for k, v in (selector.match_labels or {}).items()]
    for expr in selector.match_expressions or []:
        assert expr.operator == "In", expr
        terms.append(f"{expr.key} in ({','.join(expr.values)})")
    return ",".join(terms)


def running(pods: list[client.V1Pod]) -> list[client.V1Pod]:
    return [
        p for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
    ]


def pool_exists(env: Env, namespace: str, name: str) -> bool:
    try:
        env.pool(namespace, name)
    except ApiException as err:
        if err.status == 404:
            return False
        raise
    return True


def event_reasons(env: Env, namespace: str, name: str) -> list[str]:
    events = client.CoreV1Api(env.admin).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}"
    )
    return [e.reason for e in events.items for _ in range(e.count or 1)]


async def put_pool_data(servers: Settings, keys: PoolKeys) -> None:
    """What a running pool leaves in etcd and NATS: worker keys and a stream with a job."""
    async with etcd_client(servers) as etcd:
        await etcd.put(keys.worker("decode-0").encode(), b"{}")
        await etcd.put((keys.pool_prefix + "other").encode(), b"x")
    nc = await connect(servers, "e2e")
    try:
        queue = PrefillQueue(nc.jetstream(), keys)
        await queue.ensure_stream()
        job = PrefillJob(request_id="r-1", token_ids=(1, 2, 3), fingerprint="f" * 64,
                         dest_worker_id="decode-0", dest_incarnation=1, dest_agent_name="a",
                         dest_block_ids=(1,), first_block_index=0,
                         deadline_unix_s=time.time() + 60,
                         sampling=SamplingParams(max_tokens=1))  # fmt: skip
        await queue.publish(job)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def env(
    kube_cluster: KubeControlPlane,
    helm_binary: Path,
    gateway_api_crds: Path,
    etcd_server: EtcdServer,
    nats_server: NatsServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Env]:
    admin = config.new_client_from_config(str(kube_cluster.kubeconfig(ADMIN)))
    core = client.CoreV1Api(admin)
    for namespace in (OPERATOR_NAMESPACE, NAMESPACE, RDMA_NAMESPACE):
        try:
            core.create_namespace({"metadata": {"name": namespace}})
        except ApiException as err:
            if err.status != 409:
                raise
    setup = Env(kube_cluster, admin, admin, None)  # type: ignore[arg-type]
    httproute_crd = gateway_api_crds / "gateway.networking.k8s.io_httproutes.yaml"
    setup.kubectl("apply", "--server-side", "-f", str(REPO / "crds"), "-f", str(httproute_crd))
    crds = ("crd/inferencepools.kvrail.dev", "crd/httproutes.gateway.networking.k8s.io")
    setup.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crds)
    gpus = {"nvidia.com/gpu": "8"}
    for node, rack in RDMA_NODES.items():
        labels = {RDMA_LABEL: "true", RACK_LABEL: rack}
        kube_cluster.add_node(node, labels, {**gpus, RDMA_RESOURCE: "16"})
    kube_cluster.add_node(PLAIN_NODE, {RDMA_LABEL: "false", RACK_LABEL: "rack-a"}, gpus)
    # The RDMA example mounts its weights from a claim; bind it to a static volume.
    core.create_persistent_volume({
        "metadata": {"name": "e2e-llama-weights"},
        "spec": {"capacity": {"storage": "20Gi"}, "accessModes": ["ReadOnlyMany"],
                 "hostPath": {"path": "/models"}, "storageClassName": "",
                 "claimRef": {"namespace": RDMA_NAMESPACE, "name": "llama-3-8b-weights"}},
    })  # fmt: skip
    core.create_namespaced_persistent_volume_claim(RDMA_NAMESPACE, {
        "metadata": {"name": "llama-3-8b-weights"},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "volumeName": "e2e-llama-weights", "resources": {"requests": {"storage": "20Gi"}}},
    })  # fmt: skip
    # The chart's RBAC, applied as the admin; then the operator gets only its own token.
    root = tmp_path_factory.mktemp("operator")
    servers = {"etcd_endpoints": etcd_server.endpoint, "nats_url": nats_server.url,
               "operator_cleanup_retries": "2", "operator_cleanup_retry_delay_s": "1"}  # fmt: skip
    operator, kubeconfig, token = launch_operator(
        kube_cluster.kubeconfig(ADMIN), helm_binary, [NAMESPACE, RDMA_NAMESPACE], root, servers
    )
    operator_api = config.new_client_from_config(str(kubeconfig))
    try:
        defaults = Settings(etcd_endpoints=(etcd_server.endpoint,), nats_url=nats_server.url)
        yield Env(kube_cluster, admin, operator_api, operator, defaults)
        assert operator.is_running(), f"the operator exited\n{operator.tail()}"
    finally:
        operator.stop()
        operator_api.close()
        admin.close()
    log = (root / "operator.log").read_text()
    assert token not in log
    assert "Forbidden" not in log and " 403" not in log, "the operator lacked a permission"


def test_operator_token_is_refused_everything_it_does_not_need(env: Env) -> None:
    core = client.CoreV1Api(env.operator_api)
    rbac = client.RbacAuthorizationV1Api(env.operator_api)
    apps = client.AppsV1Api(env.operator_api)
    networking = client.NetworkingV1Api(env.operator_api)
    # What it needs works with its token ...
    client.CustomObjectsApi(env.operator_api).list_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL
    )
    with pytest.raises(ApiException) as missing:
        apps.read_namespaced_stateful_set("absent", NAMESPACE)
    assert missing.value.status == 404
    # ... and nothing else does.
    role = {"metadata": {"name": "escalate"}, "rules": []}
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    for call in (
        lambda: core.delete_node(PLAIN_NODE),
        lambda: core.list_secret_for_all_namespaces(),
        lambda: core.list_namespaced_secret(NAMESPACE),
        lambda: core.create_namespaced_pod(NAMESPACE, pod),
        lambda: rbac.create_cluster_role(role),
        lambda: apps.list_stateful_set_for_all_namespaces(),
        lambda: apps.read_namespaced_stateful_set("absent", "default"),
        lambda: networking.list_namespaced_network_policy(NAMESPACE),
        lambda: networking.read_namespaced_network_policy("absent", NAMESPACE),
        lambda: networking.delete_namespaced_network_policy("absent", "default"),
        lambda: client.CustomObjectsApi(env.operator_api).list_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL
        ),
    ):
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 403


def test_cpu_pool_lifecycle_children_ready_scale_model_change_and_delete(env: Env) -> None:
    name, ns = "smol", NAMESPACE
    start = time.monotonic()
    env.kubectl("apply", "-n", ns, "-f", str(REPO / "examples" / "cpu-small.yaml"))
    # 11 with the HTTPRoute to the chart's Gateway the example names (configmaps are listed too:
    # the router takes its settings from its environment, so there is none).
    kinds = wait_for("11 children", lambda: len(env.children(ns, name)) == 11, DEADLINE_S, 0.05)
    print(f"\napply to all 11 children created: {time.monotonic() - start:.2f}s")
    assert kinds
    uid = env.pool(ns, name)["metadata"]["uid"]
    for child in env.children(ns, name):
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["uid"], owner["controller"]) == (uid, True), child["metadata"]["name"]

    pool = wait_for("Ready", lambda: ready_at(env, ns, name), DEADLINE_S)
    print(f"apply to Ready: {time.monotonic() - start:.2f}s")
    assert pool["status"]["decode"]["readyReplicas"] == 1
    assert condition(pool, "Degraded")["status"] == "False"
    assert condition(pool, "Progressing")["status"] == "False"
    assert len(running(env.pods(ns, f"{POOL_LABEL}={name}"))) == 3
    # The workers' NetworkPolicy selects the two worker pods, not the router, and admits only
    # them on every port, anyone on the metrics port. (KWOK enforces nothing: no CNI.)
    policy = client.NetworkingV1Api(env.admin).read_namespaced_network_policy(f"{name}-workers", ns)
    selector = label_selector(policy.spec.pod_selector)
    workers = running(env.pods(ns, selector))
    assert sorted(p.metadata.labels[ROLE_LABEL] for p in workers) == ["decode", "prefill"]
    peers, metrics = policy.spec.ingress
    assert peers.ports is None and peers._from[0].namespace_selector is None
    assert label_selector(peers._from[0].pod_selector) == selector
    assert (metrics._from, [(p.protocol, p.port) for p in metrics.ports]) == (None, [("TCP", 8080)])

    # Scale decode: one more replica, Ready again at the new generation.
    env.patch_pool(ns, name, {"spec": {"decode": {"replicas": 2}}})
    pool = wait_for("Ready after scaling", lambda: ready_at(env, ns, name), DEADLINE_S)
    assert pool["status"]["decode"] == {
        **pool["status"]["decode"],
        "replicas": 2,
        "readyReplicas": 2,
    }
    assert len(running(env.pods(ns, f"{POOL_LABEL}={name},{ROLE_LABEL}=decode"))) == 2

    # A model change rolls both pools: every worker pod ends up with the new model hash.
    old_hash = pool["status"]["modelHash"]
    env.patch_pool(ns, name, {"spec": {"model": {"revision": "r2"}}})
    pool = wait_for("Ready after the model change", lambda: ready_at(env, ns, name), DEADLINE_S)
    new_hash = pool["status"]["modelHash"]
    assert new_hash != old_hash

    def rolled() -> bool:
        workers = running(env.pods(ns, f"{POOL_LABEL}={name},{ROLE_LABEL} in (prefill,decode)"))
        return len(workers) == 3 and all(
            p.metadata.labels[MODEL_HASH_LABEL] == new_hash for p in workers
        )

    wait_for("both pools rolled to the new model", rolled, DEADLINE_S)
    apps = client.AppsV1Api(env.admin)

    def settled() -> bool:
        # The StatefulSet controller records the finished rollout in status a moment after the
        # last pod is replaced, so wait for it rather than read it once.
        for role in ("prefill", "decode"):
            sts = apps.read_namespaced_stateful_set(f"{name}-{role}", ns)
            if sts.status.current_revision != sts.status.update_revision:
                return False
            assert sts.spec.template.metadata.labels[MODEL_HASH_LABEL] == new_hash
        return True

    wait_for("both StatefulSets report the rollout finished", settled, DEADLINE_S)

    # Delete: the garbage collector removes every child and pod; the finalizer removes what the
    # pool left on the real etcd and NATS: its keys and its stream with a queued job.
    assert env.servers is not None
    keys = PoolKeys(ns, name)
    asyncio.run(put_pool_data(env.servers, keys))
    assert asyncio.run(pool_traces(env.servers, keys.namespace, keys.pool)) == (2, 1)
    env.kubectl("delete", f"{PLURAL}.{GROUP}", name, "-n", ns, "--wait=false")

    def gone() -> bool:
        return not env.children(ns, name) and not env.pods(ns, f"{POOL_LABEL}={name}")

    wait_for("nothing left of the pool", gone, DEADLINE_S)
    wait_for("the pool object removed", lambda: not pool_exists(env, ns, name), DEADLINE_S)
    assert asyncio.run(pool_traces(env.servers, keys.namespace, keys.pool)) == (0, None)
    assert event_reasons(env, ns, name).count("CleanedUp") == 1


def test_rdma_pool_runs_only_on_rdma_nodes_spread_and_becomes_ready(env: Env) -> None:
    name, ns = "llama-8b", RDMA_NAMESPACE
    env.kubectl("apply", "-f", str(REPO / "examples" / "gpu-8b-rdma.yaml"))
    wait_for(
        "11 children incl. the HTTPRoute", lambda: len(env.children(ns, name)) == 11, DEADLINE_S
    )
    wait_for("Ready", lambda: ready_at(env, ns, name), DEADLINE_S)
    placed: dict[str, list[str]] = {}
    for role, replicas in (("prefill", 2), ("decode", 4)):
        pods = running(env.pods(ns, f"{POOL_LABEL}={name},{ROLE_LABEL}={role}"))
        assert len(pods) == replicas
        placed[role] = sorted(p.spec.node_name for p in pods)
        limits = pods[0].spec.containers[0].resources.limits
        assert limits["nvidia.com/gpu"] == "1" and limits[RDMA_RESOURCE] == "1"
    print(f"\nRDMA placement: {placed}")
    for role, nodes in placed.items():
        # Required node affinity and the RDMA device: never the plain node, never other nodes.
        assert set(nodes) <= set(RDMA_NODES), (role, nodes)
    # Same-role spread (best effort, maxSkew 1): the four decode workers use several nodes.
    assert len(set(placed["decode"])) >= 2, placed
    # Its etcd and NATS (spec.infrastructure) do not exist here: the finalizer retries twice,
    # then gives up with a warning Event and lets the delete finish.
    env.kubectl("delete", f"{PLURAL}.{GROUP}", name, "-n", ns, "--wait=false")
    wait_for(
        "nothing left",
        lambda: not env.children(ns, name) and not env.pods(ns, f"{POOL_LABEL}={name}"),
        DEADLINE_S,
    )
    assert not pool_exists(env, ns, name)
    reasons = event_reasons(env, ns, name)
    assert (reasons.count("CleanupRetrying"), reasons.count("CleanupAbandoned")) == (2, 1), reasons


def test_vllm_pool_runs_vllm_and_the_agent_in_every_worker_pod_and_refuses_reroute(
    env: Env,
) -> None:
    name, ns = "llama-8b-vllm", RDMA_NAMESPACE  # examples/vllm-pool.yaml, the RDMA example's claim
    example = REPO / "examples" / "vllm-pool.yaml"
    # What vLLM cannot do is refused by the real API server, with the CEL rule's message.
    refused = mutate(
        yaml.safe_load(example.read_text()),
        ("metadata.name", "vllm-reroute"),
        ("spec.disaggregation.kvLoadFailurePolicy", "reroute"),
    )
    with pytest.raises(ApiException) as err:
        client.CustomObjectsApi(env.admin).create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, refused
        )
    assert err.value.status == 422, err.value.body
    assert "kv_load_failure_policy knows only recompute and fail" in err.value.body
    assert not pool_exists(env, ns, "vllm-reroute")

    env.kubectl("apply", "-f", str(example))
    wait_for("10 children", lambda: len(env.children(ns, name)) == 10, DEADLINE_S)
    pool = wait_for("Ready", lambda: ready_at(env, ns, name), DEADLINE_S)
    assert condition(pool, "Degraded")["status"] == "False"  # every child was accepted
    assert pool["status"]["decode"]["readyReplicas"] == 2
    placed = {}
    for role, replicas in (("prefill", 1), ("decode", 2)):
        pods = running(env.pods(ns, f"{POOL_LABEL}={name},{ROLE_LABEL}={role}"))
        assert len(pods) == replicas, role
        for p in pods:
            engine, agent = p.spec.containers
            assert (engine.name, agent.name) == ("engine", "agent")
            assert engine.image.startswith("vllm/vllm-openai:")
            assert engine.command[:2] == ["vllm", "serve"]
            assert "--kv-transfer-config" in engine.command
            assert engine.resources.limits["nvidia.com/gpu"] == "1"
            assert [(c.name, c.container_port) for c in engine.ports] == [
                ("http", 8000), ("nixl", 5600),
            ]  # fmt: skip
            assert engine.startup_probe.http_get.path == "/health"
            assert agent.command == ["python", "-P", "-m", "kvrail.agent"]
            roles = [e.value for e in agent.env if e.name == "KVRAIL_ROLE"]
            assert roles == [role]
            assert not (agent.resources.limits or {}).get("nvidia.com/gpu")
        placed[role] = sorted(p.spec.node_name for p in pods)
    print(f"\nvLLM placement: {placed}")
    # The workers' policy lets the pool's routers (and only them) reach vLLM's port.
    policy = client.NetworkingV1Api(env.admin).read_namespaced_network_policy(f"{name}-workers", ns)
    router_rule = policy.spec.ingress[2]
    assert [(p.protocol, p.port) for p in router_rule.ports] == [("TCP", 8000)]
    routers = running(env.pods(ns, label_selector(router_rule._from[0].pod_selector)))
    assert sorted(p.metadata.labels[ROLE_LABEL] for p in routers) == ["router", "router"]
    assert {p.metadata.labels[POOL_LABEL] for p in routers} == {name}

    env.kubectl("delete", f"{PLURAL}.{GROUP}", name, "-n", ns, "--wait=false")
    wait_for(
        "nothing left",
        lambda: not env.children(ns, name) and not env.pods(ns, f"{POOL_LABEL}={name}"),
        DEADLINE_S,
    )


def test_child_refused_by_the_api_server_gives_degraded_not_a_crash_loop(env: Env) -> None:
    # The CRD allows any nodeSelector key; the StatefulSet validation does not.
    name, ns = "refused", NAMESPACE
    manifest = yaml.safe_load((REPO / "examples" / "cpu-small.yaml").read_text())
    manifest["metadata"] = {"name": name, "namespace": ns}
    manifest["spec"]["decode"]["nodeSelector"] = {"not a label key!": "x"}
    env.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))

    def degraded() -> dict[str, Any] | None:
        found = condition(env.pool(ns, name), "Degraded")
        return found if found.get("status") == "True" else None

    found = wait_for("Degraded", degraded, DEADLINE_S)
    assert found["reason"] == "ApplyFailed"
    assert "StatefulSet refused-decode" in found["message"] and "422" in found["message"]
    assert env.operator.is_running()
    # Fixing the spec recovers the pool.
    env.patch_pool(ns, name, {"spec": {"decode": {"nodeSelector": None}}})
    wait_for("Ready after the fix", lambda: ready_at(env, ns, name), DEADLINE_S)
    env.kubectl("delete", f"{PLURAL}.{GROUP}", name, "-n", ns, "--wait=false")
    wait_for("nothing left", lambda: not env.children(ns, name), DEADLINE_S)


def test_gaie_pool_is_degraded_without_gaies_crd_then_renders_its_gaie_objects(
    env: Env, gaie_crd: Path
) -> None:
    """The operator, under the chart's RBAC, with GAIE mode on: `InferenceExtensionMissing` while
    GAIE's CRD is absent, then, once the platform installs it, without a spec change, the GAIE
    pool, the picker and the route (the teardown checks the operator was never Forbidden)."""
    name, ns = "smol-gaie", NAMESPACE
    gaie_crd_name = "customresourcedefinition/inferencepools.inference.networking.k8s.io"
    env.kubectl("delete", gaie_crd_name, "--ignore-not-found", "--wait=true")
    env.kubectl("apply", "-n", ns, "-f", str(REPO / "examples" / "cpu-small-gaie.yaml"))

    def degraded() -> dict[str, Any] | None:
        found = condition(env.pool(ns, name), "Degraded")
        return found if found.get("status") == "True" else None

    found = wait_for("Degraded", degraded, DEADLINE_S)
    assert found["reason"] == "InferenceExtensionMissing"
    assert "inference.networking.k8s.io" in found["message"]
    assert "InferenceExtensionMissing" in event_reasons(env, ns, name)

    env.kubectl("apply", "--server-side", "-f", str(gaie_crd))
    env.kubectl("wait", "--for=condition=Established", "--timeout=60s", gaie_crd_name)
    objects = client.CustomObjectsApi(env.admin)

    def gaie_pool() -> dict[str, Any] | None:
        try:
            return objects.get_namespaced_custom_object(  # type: ignore[no-any-return]
                "inference.networking.k8s.io", "v1", ns, "inferencepools", f"{name}-gaie"
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    # The operator retries a missing CRD every minute.
    found_pool = wait_for("the GAIE pool", gaie_pool, 2 * DEADLINE_S)
    assert found_pool["spec"]["endpointPickerRef"]["name"] == f"{name}-epp"
    route = objects.get_namespaced_custom_object(
        "gateway.networking.k8s.io", "v1", ns, "httproutes", f"{name}-gaie"
    )
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    assert client.AppsV1Api(env.admin).read_namespaced_deployment(f"{name}-epp", ns)
    wait_for(
        "not Degraded",
        lambda: condition(env.pool(ns, name), "Degraded").get("status") == "False",
        DEADLINE_S,
    )
    env.kubectl("delete", f"{PLURAL}.{GROUP}", name, "-n", ns, "--wait=false")
    wait_for("nothing left", lambda: not env.children(ns, name), DEADLINE_S)
    wait_for("the GAIE pool collected", lambda: gaie_pool() is None, DEADLINE_S)


def test_helm_install_of_the_chart_creates_every_object(env: Env, helm_binary: Path) -> None:
    release = "kvrail-helm"  # its own namespace and release, beside the operator under test
    done = subprocess.run(
        [str(helm_binary), "install", release, str(REPO / "charts" / "kvrail"),
         "--namespace", release, "--create-namespace", "--kubeconfig",
         str(env.plane.kubeconfig(ADMIN)), "--set", "etcd.persistence.enabled=false",
         "--set", "nats.persistence.enabled=false", "--timeout", "90s"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "kubectl get kvpool" in done.stdout  # NOTES
    apps = client.AppsV1Api(env.admin)
    assert apps.read_namespaced_deployment(f"{release}-operator", release)
    networking = client.NetworkingV1Api(env.admin)
    for name in (f"{release}-etcd", f"{release}-nats"):
        assert apps.read_namespaced_stateful_set(name, release).spec.replicas == 1
        assert networking.read_namespaced_network_policy(name, release).spec.ingress
    # The post-install Job that enables etcd authentication ran (KWOK completes its pod).
    jobs = client.BatchV1Api(env.admin).list_namespaced_job(release).items
    assert not [j.metadata.name for j in jobs if not j.status.succeeded]
    secret = client.CoreV1Api(env.admin).read_namespaced_secret(
        f"{release}-etcd-credentials", release
    )
    assert set(secret.data) == {"username", "password"}
    uninstall = subprocess.run(
        [str(helm_binary), "uninstall", release, "--namespace", release, "--kubeconfig",
         str(env.plane.kubeconfig(ADMIN)), "--timeout", "60s"],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert uninstall.returncode == 0, uninstall.stderr
