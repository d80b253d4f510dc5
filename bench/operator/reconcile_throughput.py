"""Reconcile throughput of the operator: create N small pools at once, time until every pool has
all of its children, and until every pool reports status for its generation.

Runs the same harness as tests/e2e (kube-apiserver, controller-manager, scheduler, KWOK) in a
temporary folder, the operator under the chart's RBAC with its own ServiceAccount token.

    .venv/bin/python -P bench/operator/reconcile_throughput.py --pools 100
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml
from kubernetes import client, config

from kvrail.crd.pool import GROUP, PLURAL, VERSION
from kvrail.operator.builders.meta import POOL_LABEL
from kvrail.operator.testing import pool_manifest
from kvrail.testing.kube import ADMIN, KubeControlPlane, default_bin_dir
from kvrail.testing.operator_process import (
    REPO,
    launch_operator,
    wait_for,
)

NAMESPACE = "bench"
CHILDREN_PER_POOL = 9  # 3 Services, 2 StatefulSets, a Deployment, 3 PDBs (no router ConfigMap)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=1, help="per role (0: no pods at all)")
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args()
    cache = Path(os.environ.get("K8S_HARNESS_CACHE") or Path.home() / ".cache/kvrail/k8s")
    bin_dir = default_bin_dir(cache)
    workdir = Path(tempfile.mkdtemp(prefix="kvrail-bench-operator-"))
    plane = KubeControlPlane(workdir, bin_dir)
    operator = None
    try:
        plane.start()
        plane.start_cluster_components()
        for i in range(4):
            plane.add_node(f"bench-node-{i}", capacity={"cpu": "256", "pods": "250"})
        admin = config.new_client_from_config(str(plane.kubeconfig(ADMIN)))
        ext = client.ApiextensionsV1Api(admin)
        crd = yaml.safe_load((REPO / "crds" / "kvrail.dev_inferencepools.yaml").read_text())
        ext.create_custom_resource_definition(crd)
        operator, _, _ = launch_operator(
            plane.kubeconfig(ADMIN), bin_dir / "helm", [NAMESPACE], workdir
        )
        objects = client.CustomObjectsApi(admin)

        start = time.monotonic()
        for i in range(args.pools):
            manifest = pool_manifest(f"pool-{i:03d}", NAMESPACE)
            for role in ("prefill", "decode"):
                manifest["spec"][role] = {"replicas": args.replicas}
            manifest["spec"]["router"] = {"replicas": args.replicas}
            objects.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, manifest)
        created_s = time.monotonic() - start

        def complete() -> bool:
            counts = _children_per_pool(plane)
            return sum(1 for n in counts.values() if n == CHILDREN_PER_POOL) == args.pools

        wait_for("all children", complete, args.timeout_s, 0.25)
        children_s = time.monotonic() - start

        def reported() -> bool:
            pools = objects.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
            return all(p.get("status", {}).get("observedGeneration") == 1 for p in pools["items"])

        wait_for("all statuses", reported, args.timeout_s, 0.25)
        status_s = time.monotonic() - start
        print(f"pools={args.pools} replicas_per_role={args.replicas} cores={os.cpu_count()}")
        print(f"create requests sent: {created_s:.1f}s")
        print(f"all {args.pools * CHILDREN_PER_POOL} children exist: {children_s:.1f}s "
              f"({args.pools / children_s:.1f} pools/s)")  # fmt: skip
        print(f"every pool has status for its generation: {status_s:.1f}s")
    finally:
        if operator is not None:
            operator.stop()
        plane.stop()
        print(f"logs: {workdir}")


def _children_per_pool(plane: KubeControlPlane) -> Counter[str]:
    counts: Counter[str] = Counter()
    for prefix, kind in (
        ("/api/v1", "services"),
        ("/apis/apps/v1", "statefulsets"),
        ("/apis/apps/v1", "deployments"),
        ("/apis/policy/v1", "poddisruptionbudgets"),
    ):
        got = plane.api("GET", f"{prefix}/namespaces/{NAMESPACE}/{kind}?labelSelector={POOL_LABEL}")
        counts.update(item["metadata"]["labels"][POOL_LABEL] for item in got["items"])
    return counts


if __name__ == "__main__":
    main()
