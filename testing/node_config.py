"""What a real test node is made of: its addresses and folders, and the configuration files of
containerd, the CNI bridge, the kubelet and kube-proxy, as pure functions of them.

The node lives in its own network namespace, joined to the host by one veth pair: the host end
carries the API server's address, the node end the node's InternalIP. Inside: the CNI bridge with
the pods, kube-proxy's rules, and no route anywhere else, so pod traffic can reach the node, the
other pods, Services and the API server, and nothing outside this machine. The host routes the
pod, Service and load-balancer ranges to the node end (the test's clients reach the Gateway that
way); those routes go when the veth does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NODE_NAME = "kvrail-node"
CNI_NETWORK = "kvrail-node"
CLUSTER_DOMAIN = "cluster.local"
# The node's kernel settings the kubelet insists on (it writes them when they differ, and these
# are not per network namespace); the kubelet reads them from files shadowing /proc/sys in its own
# mount namespace, so the host keeps its own values.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}


@dataclass(frozen=True, slots=True)
class NodeNetwork:
    """Names and addresses; one node per machine at a time (`kvrail.testing.node` locks)."""

    netns: str = "kvrail-node"
    host_if: str = "kvrail-h0"
    node_if: str = "kvrail-n0"
    bridge: str = "kvrail0"
    host_ip: str = "10.250.0.1"
    node_ip: str = "10.250.0.2"
    link_prefix: int = 30
    pod_cidr: str = "10.244.0.0/24"
    pod_gateway: str = "10.244.0.1"
    cluster_cidr: str = "10.244.0.0/16"
    service_cidr: str = "10.96.0.0/16"
    """The API server's --service-cluster-ip-range (`kvrail.testing.kube`)."""
    dns_ip: str = "10.96.0.10"
    lb_cidr: str = "10.250.1.0/24"
    """Addresses the harness hands to LoadBalancer Services, as a cloud would."""

    @property
    def routed_cidrs(self) -> tuple[str, ...]:
        """What the host routes into the node."""
        return (self.cluster_cidr, self.service_cidr, self.lb_cidr)


@dataclass(frozen=True, slots=True)
class NodePaths:
    """Every folder and socket of one node. `workdir` is this run's; `containerd_root` is kept
    between runs (images and their unpacked layers: 6.5 GB that would take minutes to load)."""

    workdir: Path
    containerd_root: Path

    @property
    def containerd_state(self) -> Path:
        return self.workdir / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd_state / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.workdir / "containerd.toml"

    @property
    def cni_conf_dir(self) -> Path:
        return self.workdir / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.workdir / "cni" / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.workdir / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.workdir / "kubelet.yaml"

    @property
    def pod_logs(self) -> Path:
        return self.workdir / "pod-logs"

    @property
    def resolv_conf(self) -> Path:
        return self.workdir / "resolv.conf"

    @property
    def sysctl_shadows(self) -> Path:
        return self.workdir / "sysctl"

    @property
    def kube_proxy_config(self) -> Path:
        return self.workdir / "kube-proxy.yaml"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"


def containerd_toml(paths: NodePaths, sandbox_image: str, cri: bool = True) -> str:
    """containerd 1.6 (Debian's) with the CRI plugin (`cri=False`: without it, to tidy the kept
    root first). runc, not crun: crun refuses this machine's hybrid cgroup layout.
    `restrict_oom_score_adj`: root here lacks CAP_SYS_RESOURCE, and runc dies ("can't get final
    child's PID from pipe") when asked to lower a score. Network namespaces and runc's state
    live under this run's folder, so a sweep finds them."""
    state = paths.containerd_state
    disabled = [f"io.containerd.snapshotter.v1.{n}" for n in ("aufs", "btrfs", "zfs", "devmapper")]
    if not cri:
        disabled.append("io.containerd.grpc.v1.cri")
    cri_table = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{paths.containerd_root}"
state = "{state}"
disabled_plugins = {json.dumps(disabled)}

[grpc]
  address = "{paths.containerd_socket}"

[{cri_table}]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [{cri_table}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri_table}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri_table}.containerd.runtimes.runc.options]
        Root = "{state / "runc"}"
  [{cri_table}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{paths.cni_conf_dir}"
    max_conf_num = 1

[plugins."io.containerd.internal.v1.opt"]
  path = "{paths.containerd_root / "opt"}"
"""


def cni_conflist(net: NodeNetwork, paths: NodePaths) -> dict[str, Any]:
    """A Linux bridge with the node end as every pod's gateway, no masquerading (nothing is
    reachable beyond the node to masquerade for) and hairpin mode (a pod reaching itself through
    a Service)."""
    return {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": net.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": net.pod_cidr, "gateway": net.pod_gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(paths.cni_ipam_dir),
                },
            }
        ],
    }


def kubelet_configuration(
    net: NodeNetwork, paths: NodePaths, client_ca: Path, cgroup_root: str, healthz_port: int
) -> dict[str, Any]:
    """The kubelet: webhook authentication and authorization against the API server (no
    anonymous access), cgroupfs on the machine's cgroup v1 hierarchies under `cgroup_root`, and
    every folder it writes under this run's. Eviction thresholds are low: the machine's disk and
    memory are shared with other work, and a test must not lose its pods to a busy neighbour."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": net.node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(client_ca)},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{paths.containerd_socket}",
        "clusterDNS": [net.dns_ip],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(paths.resolv_conf),
        "podLogsDir": str(paths.pod_logs),
        "volumePluginDir": str(paths.workdir / "volume-plugins"),
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "protectKernelDefaults": False,
        "shutdownGracePeriod": "0s",
        "serializeImagePulls": False,
        "maxPods": 40,
    }


def kube_proxy_configuration(
    net: NodeNetwork, kubeconfig: Path, healthz_port: int, metrics_port: int
) -> dict[str, Any]:
    """kube-proxy in iptables mode inside the node's namespace. The conntrack settings are left
    alone (zeros): they are global to the machine, not per namespace."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NODE_NAME,
        "mode": "iptables",
        "clusterCIDR": net.cluster_cidr,
        "detectLocalMode": "ClusterCIDR",
        "healthzBindAddress": f"{net.node_ip}:{healthz_port}",
        "metricsBindAddress": f"{net.node_ip}:{metrics_port}",
        "nodePortAddresses": [f"{net.node_ip}/32"],
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "iptables": {"localhostNodePorts": False, "syncPeriod": "5s", "minSyncPeriod": "0s"},
    }
