"""A whole real cluster on this machine, as the tests of `tests/node/` use it: the harness's
control plane, one real node (`kvrail.testing.node`), cluster DNS, the Gateway API CRDs and
Traefik with its GatewayClass, and kvrail's image loaded into the node's containerd.

    with real_cluster(workdir, bin_dir, cache) as cluster:
        kubectl(cluster.kubeconfig, "get", "nodes")

Everything it started is stopped when the block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvrail.testing import cluster_dns, gateway
from kvrail.testing.kube import KubeControlPlane
from kvrail.testing.kubectl import apply, kubectl
from kvrail.testing.node import NODE_USERS, RealNode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RealCluster:
    plane: KubeControlPlane
    node: RealNode
    kvrail_image: str
    """kvrail's image as loaded into the node (`localhost/kvrail:dev-<hash>`)."""
    platform_images: dict[str, str]
    """pause, coredns, traefik, etcd and nats references (`hack/node-images.sh`)."""
    gateway_address: str
    """Traefik's LoadBalancer address: what Gateways of class `traefik` report."""

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig()

    def chart_sets(self) -> list[str]:
        """`helm install` arguments for kvrail's chart on this node: the images loaded into it
        (a mirror, as an air-gapped cluster has) and no persistence (the node has no storage
        provisioner)."""
        repo, tag = self.kvrail_image.rsplit(":", 1)
        sets = {"operator.image.repository": repo, "operator.image.tag": tag}
        sets["operator.image.pullPolicy"] = "Never"
        for server in ("etcd", "nats"):
            repo, tag = self.platform_images[server].rsplit(":", 1)
            sets[f"{server}.image.repository"], sets[f"{server}.image.tag"] = repo, tag
            sets[f"{server}.image.pullPolicy"] = "Never"
            sets[f"{server}.persistence.enabled"] = "false"
        return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


@contextlib.contextmanager
def real_cluster(workdir: Path, bin_dir: Path, cache: Path) -> Iterator[RealCluster]:
    """Bring it all up (a few minutes cold, mostly loading the image; about 40 s warm)."""
    start = time.monotonic()
    node = RealNode(workdir / "node", cache / "node")
    plane = KubeControlPlane(
        workdir / "kube", bin_dir, address=node.net.host_ip, extra_users=NODE_USERS
    )
    node.acquire(plane.port)
    try:
        plane.start()
        plane.start_cluster_components(kwok=False)
        admin = plane.kubeconfig()
        crds = bin_dir.parent / "gateway-api"
        kubectl(admin, "apply", "--server-side", "-f", str(crds))
        kubectl(admin, "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
        node.start(plane, bin_dir)
        images = node.images
        apply(admin, cluster_dns.manifests(node.net, images["coredns"]))
        apply(admin, gateway.manifests(images["traefik"]))
        address = gateway.assign_load_balancers(admin, node.net)[
            f"{gateway.NAMESPACE}/{gateway.NAME}"
        ]
        kvrail_image = node.import_kvrail_image()
        for namespace, name in ((cluster_dns.NAMESPACE, cluster_dns.NAME),
                                (gateway.NAMESPACE, gateway.NAME)):  # fmt: skip
            kubectl(admin, "rollout", "status", f"deployment/{name}", "-n", namespace,
                    "--timeout=180s", timeout_s=200)  # fmt: skip
        log.info("real cluster up seconds=%.1f gateway=%s", time.monotonic() - start, address)
        yield RealCluster(plane, node, kvrail_image, images, address)
    finally:
        try:
            node.stop()
        finally:
            try:
                plane.stop()
            finally:
                node.release()
