"""The full harness: controller-manager, scheduler and KWOK place real pods on fake nodes."""

from __future__ import annotations

import time

import pytest
from kubernetes import client, config

from kvrail.testing.kube import KubeControlPlane

pytestmark = pytest.mark.cluster
RDMA_LABEL = "feature.node.kubernetes.io/rdma.capable"
GROUP_LABEL = "harness.kvrail.dev/group"  # other tests add RDMA nodes to the shared cluster


def test_statefulset_pods_land_only_on_nodes_the_affinity_allows(
    kube_cluster: KubeControlPlane,
) -> None:
    for name, rdma in (("gpu-rdma-0", "true"), ("gpu-rdma-1", "true"), ("cpu-0", "false")):
        kube_cluster.add_node(
            name, labels={RDMA_LABEL: rdma, GROUP_LABEL: "sts"}, capacity={"nvidia.com/gpu": "8"}
        )
    api = config.new_client_from_config(str(kube_cluster.kubeconfig()))
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    core.create_namespace({"metadata": {"name": "harness-sts"}})
    labels = {"app": "rdma-sts"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": RDMA_LABEL, "operator": "In", "values": ["true"]},
            {"key": GROUP_LABEL, "operator": "In", "values": ["sts"]}]}]}}}  # fmt: skip
    apps.create_namespaced_stateful_set("harness-sts", {
        "metadata": {"name": "rdma-sts"},
        "spec": {
            "replicas": 3, "serviceName": "rdma-sts", "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "affinity": affinity,
                "containers": [{"name": "c", "image": "fake.invalid/none:0",
                                "resources": {"limits": {"nvidia.com/gpu": "4"}}}]}},
        },
    })  # fmt: skip
    deadline = time.monotonic() + 90
    while True:
        pods = core.list_namespaced_pod("harness-sts", label_selector="app=rdma-sts").items
        running = [p for p in pods if p.status.phase == "Running"]
        if len(running) == 3:
            break
        assert time.monotonic() < deadline, [(p.metadata.name, p.status.phase) for p in pods]
        time.sleep(0.5)
    nodes = sorted(p.spec.node_name for p in running)
    assert all(n.startswith("gpu-rdma-") for n in nodes), nodes
    # 8 GPUs per node, 4 per pod: the third pod cannot share a node with two others.
    assert len(set(nodes)) == 2
