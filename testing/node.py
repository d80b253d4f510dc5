"""A real Kubernetes node for tests: containerd, runc, CNI bridge networking, the kubelet and
kube-proxy, joined to a `KubeControlPlane`. Pods run in real containers from real images.

    node = RealNode(workdir, cache)
    node.acquire()                       # lock, sweep leftovers, create the node's network
    plane = KubeControlPlane(root, bin_dir, address=node.net.host_ip, extra_users=NODE_USERS)
    plane.start(); plane.start_cluster_components(kwok=False)
    node.start(plane, bin_dir)           # containerd, platform images, kubelet, kube-proxy
    ...
    node.stop()                          # pods, processes, mounts, cgroups (by PID, by path)
    node.release()                       # the network, the lock

One node per machine at a time (a file lock): its names and addresses are fixed
(`kvrail.testing.node_config`). containerd's root (images and their unpacked layers) is kept under
the cache between runs; everything else lives in the run's folder and is swept at the end, and
again before the next node starts in case a run was killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import yaml

from kvrail.local.procs import ManagedProcess, free_port, http_ok
from kvrail.testing import node_network, node_sweep
from kvrail.testing.kube import KubeControlPlane
from kvrail.testing.node_config import (
    CNI_NETWORK,
    KUBELET_SYSCTLS,
    NODE_NAME,
    NodeNetwork,
    NodePaths,
    cni_conflist,
    containerd_toml,
    kube_proxy_configuration,
    kubelet_configuration,
)

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
NODE_USER = f"system:node:{NODE_NAME}"
PROXY_USER = "system:kube-proxy"
NODE_USERS = {NODE_USER: ("system:nodes",), PROXY_USER: ()}
"""Token identities the control plane must know: the kubelet (Node authorizer) and kube-proxy
(bound to system:node-proxier by the API server's bootstrap RBAC)."""
CGROUP_ROOT = "/kvrail-node"
LOCK_WAIT_S = 1200.0
NODE_TOOLS = ("containerd", "runc", "ctr", "iptables", "conntrack", "nsenter", "unshare", "ip",
              "buildah", "skopeo", "debootstrap", "gcc")  # fmt: skip
NODE_BINARIES = ("kubelet", "kube-proxy", "coredns", "traefik", "etcdctl", "nats-server")


class NodeError(RuntimeError):
    """The node could not be brought up; the message says which part and where its log is."""


class RealNode:
    """One node; `acquire()` before the control plane starts (it needs the node's link),
    `start()` after it. `stop()` and `release()` are idempotent and run whatever failed before."""

    def __init__(self, workdir: Path, cache: Path, net: NodeNetwork | None = None) -> None:
        self.net = net or NodeNetwork()
        self.cache = cache
        self.paths = NodePaths(workdir=workdir, containerd_root=cache / "containerd")
        self.images: dict[str, str] = {}
        self._lock: IO[str] | None = None
        self._procs: list[ManagedProcess] = []
        self._shared_mount = False

    # -- lifecycle --------------------------------------------------------------------------------
    def acquire(self, api_port: int, lock_wait_s: float = LOCK_WAIT_S) -> None:
        """Take the machine's node lock, sweep what an earlier run left, create the network
        (pods may reach the host only at `api_port`)."""
        self.cache.mkdir(parents=True, exist_ok=True)
        self._lock = _take_lock(self.cache / "lock", lock_wait_s)
        self._sweep(self._previous_workdirs())
        (self.cache / "last-workdir").write_text(str(self.paths.workdir))
        node_network.create(self.net, api_port)

    def start(self, plane: KubeControlPlane, bin_dir: Path, timeout_s: float = 300.0) -> None:
        """containerd with the platform images, then the kubelet (until the Node is Ready) and
        kube-proxy."""
        p = self.paths
        for d in (p.containerd_state, p.cni_conf_dir, p.cni_ipam_dir, p.kubelet_root, p.pod_logs,
                  p.logs, p.containerd_root):  # fmt: skip
            d.mkdir(parents=True, exist_ok=True)
        self._share_workdir()
        self.images = self._start_containerd()
        self._start_kubelet(plane, bin_dir, timeout_s)
        self._start_kube_proxy(plane, bin_dir, timeout_s)

    def stop(self) -> None:
        """Stop kube-proxy, the kubelet and containerd by PID, then sweep: every container
        process (SIGKILL by cgroup), every shim, every mount and cgroup. No pod is drained: a
        test tears down what it made (helm uninstall), and the rest is only a test's debris."""
        for proc in reversed(self._procs):
            proc.stop()
        self._procs.clear()
        self._sweep([self.paths.workdir])

    def release(self) -> None:
        """Remove the network and give up the lock."""
        try:
            node_network.delete(self.net)
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    # -- images -----------------------------------------------------------------------------------
    def import_kvrail_image(self) -> str:
        """Build kvrail's image if its inputs changed (`hack/image.sh`) and load it; its
        reference."""
        out = _script(["hack/image.sh", "import", str(self.paths.containerd_socket)])
        return out.splitlines()[-1]

    def import_gaie_images(self, suite: bool = False) -> dict[str, str]:
        """The GAIE tier's images (`hack/gaie-images.sh`: Envoy Gateway, its Envoy, AI Gateway's
        controller; with `suite`, the conformance suite's picker and echo server too), built if
        missing and loaded: name -> reference, the suite's own tags as `suite-<name>`."""
        argv = ["hack/gaie-images.sh", "import", str(self.paths.containerd_socket)]
        return _refs(_script(argv, {"GAIE_IMAGES": "all" if suite else "gateway"}))

    def ctr(self, *args: str) -> str:
        done = subprocess.run(
            ["ctr", "-a", str(self.paths.containerd_socket), "-n", "k8s.io", *args],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return done.stdout

    # -- internals --------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.paths.logs / f"{name}.log").start()
        self._procs.append(proc)
        return proc

    def _share_workdir(self) -> None:
        """Make the run folder a shared mount: the kubelet runs in its own mount namespace (for
        the sysctl shadows) and its volume mounts must still reach containerd."""
        w = str(self.paths.workdir)
        node_network.run("mount", "--bind", w, w)
        node_network.run("mount", "--make-rshared", w)
        self._shared_mount = True

    def _start_containerd(self) -> dict[str, str]:
        p = self.paths
        pause_ref = _platform_refs()["pause"]
        # First without the CRI plugin: forget containers an earlier run left in the kept root,
        # before the CRI plugin would load them as live sandboxes.
        p.containerd_config.write_text(containerd_toml(p, pause_ref, cri=False))
        proc = self._spawn("containerd-prune", node_network.in_node(
            self.net, "containerd", "--config", str(p.containerd_config)))  # fmt: skip
        proc.wait_ready(lambda: p.containerd_socket.exists() and self._ctr_ok(), 60, 0.1)
        for cid in self.ctr("containers", "ls", "-q").split():
            with contextlib.suppress(subprocess.CalledProcessError):
                self.ctr("tasks", "rm", "-f", cid)
            self.ctr("containers", "rm", cid)
            log.info("removed leftover container id=%s", cid)
        proc.stop()
        self._procs.remove(proc)
        p.containerd_config.write_text(containerd_toml(p, pause_ref))
        (p.cni_conf_dir / "10-kvrail.conflist").write_text(
            json.dumps(cni_conflist(self.net, p), indent=2)
        )
        proc = self._spawn("containerd", node_network.in_node(
            self.net, "containerd", "--config", str(p.containerd_config)))  # fmt: skip
        proc.wait_ready(lambda: p.containerd_socket.exists() and self._ctr_ok(), 60, 0.1)
        out = _script(["hack/node-images.sh", "import", str(p.containerd_socket)])
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def _ctr_ok(self) -> bool:
        try:
            self.ctr("version")
        except subprocess.CalledProcessError:
            return False
        return True

    def _start_kubelet(self, plane: KubeControlPlane, bin_dir: Path, timeout_s: float) -> None:
        p = self.paths
        _make_cgroup_root(CGROUP_ROOT)
        p.resolv_conf.write_text("# the node has no upstream resolver: pods use cluster DNS\n")
        healthz = free_port()
        config = kubelet_configuration(self.net, p, plane.pki.ca_crt, CGROUP_ROOT, healthz)
        p.kubelet_config.write_text(yaml.safe_dump(config))
        shadows = []
        for key, value in KUBELET_SYSCTLS.items():
            f = p.sysctl_shadows / key
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(value + "\n")
            shadows.append(f"mount --bind {f} /proc/sys/{key}")
        kubelet = [
            str(bin_dir / "kubelet"), f"--config={p.kubelet_config}",
            f"--kubeconfig={plane.kubeconfig(NODE_USER)}", f"--root-dir={p.kubelet_root}",
            f"--cert-dir={p.kubelet_root / 'pki'}", f"--hostname-override={NODE_NAME}",
            f"--node-ip={self.net.node_ip}", "--v=1",
        ]  # fmt: skip
        exec_kubelet = "exec " + " ".join(node_network.in_node(self.net, *kubelet))
        script = " && ".join([*shadows, exec_kubelet])
        unshare = ["unshare", "--mount", "--propagation", "unchanged", "--"]
        proc = self._spawn("kubelet", [*unshare, "/bin/sh", "-c", script])
        proc.wait_ready(lambda: self._node_ready(plane), timeout_s, 0.5)
        log.info("node ready name=%s ip=%s", NODE_NAME, self.net.node_ip)

    def _start_kube_proxy(self, plane: KubeControlPlane, bin_dir: Path, timeout_s: float) -> None:
        healthz = free_port()
        config = kube_proxy_configuration(
            self.net, plane.kubeconfig(PROXY_USER), healthz, free_port()
        )
        self.paths.kube_proxy_config.write_text(yaml.safe_dump(config))
        proc = self._spawn("kube-proxy", node_network.in_node(
            self.net, str(bin_dir / "kube-proxy"), f"--config={self.paths.kube_proxy_config}",
            "--v=1"))  # fmt: skip
        url = f"http://{self.net.node_ip}:{healthz}/healthz"
        proc.wait_ready(lambda: http_ok(url), timeout_s, 0.5)

    def _node_ready(self, plane: KubeControlPlane) -> bool:
        try:
            node = plane.api("GET", f"/api/v1/nodes/{NODE_NAME}")
        except OSError:
            return False
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _previous_workdirs(self) -> list[Path]:
        marker = self.cache / "last-workdir"
        return [Path(marker.read_text().strip())] if marker.is_file() else []

    def _sweep(self, workdirs: list[Path]) -> None:
        socket_paths = [
            NodePaths(w, self.paths.containerd_root).containerd_socket for w in workdirs
        ]
        for sock in socket_paths:
            node_sweep.kill_all(node_sweep.shim_pids(sock), "containerd-shim")
        for sock in socket_paths:
            node_sweep.kill_node_processes(CGROUP_ROOT, sock)
        count = node_sweep.unmount_under([*workdirs, self.paths.containerd_root])
        if count:
            log.info("unmounted count=%d", count)
        node_sweep.remove_cgroups(CGROUP_ROOT)
        node_sweep.remove_cni_results(CNI_NETWORK)
        if node_network.exists(self.net) and not self._procs:
            node_network.delete(self.net)


def _take_lock(path: Path, wait_s: float) -> IO[str]:
    f = path.open("a")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() > deadline:
                f.close()
                raise NodeError(f"another real node holds {path} (waited {wait_s:.0f}s)") from None
            time.sleep(1.0)


def _make_cgroup_root(cgroup_root: str) -> None:
    """The node's cgroup in every hierarchy; a v1 cpuset one needs its parent's CPUs and memory
    nodes before any task can join it."""
    for d in node_sweep.cgroup_dirs(cgroup_root):
        d.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (d / name).is_file() and not (d / name).read_text().strip():
                (d / name).write_text((d.parent / name).read_text())


def _platform_refs() -> dict[str, str]:
    return _refs(_script(["hack/node-images.sh", "build"]))


def _refs(out: str) -> dict[str, str]:
    """An image script's `name=reference` lines."""
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _script(argv: list[str], extra_env: dict[str, str] | None = None) -> str:
    """Run a repository script; its stdout. Failures raise with its stderr."""
    env = {**os.environ, "VENV": sys.prefix, **(extra_env or {})}
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise NodeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout
