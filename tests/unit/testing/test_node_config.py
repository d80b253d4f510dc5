"""The real node's configuration files (`kvrail.testing.node_config`): everything a run writes
stays in its folders, nothing listens beyond the node's own address, and the settings that made
containerd, runc and the kubelet work on these machines are there."""

from __future__ import annotations

import ipaddress
import json
import tomllib
from pathlib import Path
from typing import Any

from kvrail.testing.node_config import (
    NodeNetwork,
    NodePaths,
    cni_conflist,
    containerd_toml,
    kube_proxy_configuration,
    kubelet_configuration,
)

NET = NodeNetwork()
PATHS = NodePaths(workdir=Path("/tmp/run/node"), containerd_root=Path("/cache/node/containerd"))


def paths_in(value: Any) -> list[str]:
    """Every absolute path among the strings of a nested config."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in paths_in(v)]
    if isinstance(value, list):
        return [p for v in value for p in paths_in(v)]
    if isinstance(value, str):
        value = value.removeprefix("unix://")
        return [value] if value.startswith("/") else []
    return []


def owned(path: str) -> bool:
    roots = (str(PATHS.workdir), str(PATHS.containerd_root), "/usr/lib/cni")
    return any(path == r or path.startswith(r + "/") for r in roots)


def test_containerd_keeps_its_state_in_the_run_and_its_images_in_the_cache() -> None:
    config = tomllib.loads(containerd_toml(PATHS, "localhost/pause:1"))
    assert config["root"] == str(PATHS.containerd_root)
    assert all(owned(p) for p in paths_in(config)), paths_in(config)
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True  # root here lacks CAP_SYS_RESOURCE
    assert cri["netns_mounts_under_state_dir"] is True
    assert cri["sandbox_image"] == "localhost/pause:1"
    assert cri["stream_server_address"] == "127.0.0.1"
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["runtime_type"] == "io.containerd.runc.v2"
    assert owned(runc["options"]["Root"])
    assert "io.containerd.grpc.v1.cri" not in config["disabled_plugins"]
    pruning = tomllib.loads(containerd_toml(PATHS, "localhost/pause:1", cri=False))
    assert "io.containerd.grpc.v1.cri" in pruning["disabled_plugins"]


def test_pods_get_a_bridge_without_masquerading_and_addresses_from_the_run() -> None:
    config = cni_conflist(NET, PATHS)
    (bridge,) = config["plugins"]
    assert bridge["ipMasq"] is False and bridge["isGateway"] is True
    assert owned(bridge["ipam"]["dataDir"])
    json.dumps(config)


def test_the_kubelet_authenticates_every_caller_and_writes_only_in_the_run() -> None:
    config = kubelet_configuration(NET, PATHS, PATHS.workdir / "ca.crt", "/kvrail-node", 10248)
    assert config["authentication"]["anonymous"] == {"enabled": False}
    assert config["authentication"]["webhook"] == {"enabled": True}
    assert config["authorization"] == {"mode": "Webhook"}
    assert config["readOnlyPort"] == 0
    assert config["address"] == NET.node_ip and config["healthzBindAddress"] == "127.0.0.1"
    assert config["cgroupRoot"] == "/kvrail-node" and config["cgroupDriver"] == "cgroupfs"
    assert config["clusterDNS"] == [NET.dns_ip]
    files = paths_in({k: v for k, v in config.items() if k != "cgroupRoot"})
    assert all(owned(p) for p in files), files


def test_kube_proxy_binds_the_node_and_leaves_the_machines_conntrack_alone() -> None:
    config = kube_proxy_configuration(NET, PATHS.workdir / "proxy.kubeconfig", 1, 2)
    assert config["mode"] == "iptables"
    assert config["healthzBindAddress"].startswith(NET.node_ip + ":")
    assert config["metricsBindAddress"].startswith(NET.node_ip + ":")
    assert set(config["conntrack"].values()) == {0, "0s"}
    assert config["iptables"]["localhostNodePorts"] is False


def test_the_nodes_ranges_are_private_and_do_not_overlap() -> None:
    link = ipaddress.ip_network(f"{NET.host_ip}/{NET.link_prefix}", strict=False)
    assert {ipaddress.ip_address(NET.host_ip), ipaddress.ip_address(NET.node_ip)} <= set(link)
    ranges = [link, *(ipaddress.ip_network(c) for c in NET.routed_cidrs)]
    assert all(r.is_private for r in ranges)
    for i, a in enumerate(ranges):
        for b in ranges[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    assert ipaddress.ip_network(NET.pod_cidr).subnet_of(ipaddress.ip_network(NET.cluster_cidr))
    assert ipaddress.ip_address(NET.dns_ip) in ipaddress.ip_network(NET.service_cidr)
