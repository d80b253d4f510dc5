"""The real node's network: its namespace, the veth pair to the host, the host's routes into it,
and a firewall that keeps pods away from the host's other services.

Everything lives in the node's namespace except the host end of the veth and the routes through
it, which the kernel removes with the namespace. `delete()` is safe to call on nothing.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from kvrail.testing.node_config import NodeNetwork

log = logging.getLogger(__name__)

EGRESS_CHAIN = "KVRAIL-NODE-EGRESS"


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """A command whose failure raises with its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def netns_path(net: NodeNetwork) -> Path:
    return Path("/run/netns") / net.netns


def in_node(net: NodeNetwork, *argv: str) -> list[str]:
    """`argv` run in the node's network namespace (and nothing else: the mount namespace stays
    the host's, where the kubelet's volume mounts must be visible to containerd)."""
    return ["nsenter", f"--net={netns_path(net)}", "--", *argv]


def create(net: NodeNetwork, api_port: int) -> None:
    """The namespace, the link, the routes, forwarding and the egress firewall. Pods may open
    connections to the API server's port on the host and nowhere else outside the node."""
    run("ip", "netns", "add", net.netns)
    run("ip", "link", "add", net.host_if, "type", "veth", "peer", "name", net.node_if,
        "netns", net.netns)  # fmt: skip
    run("ip", "addr", "add", f"{net.host_ip}/{net.link_prefix}", "dev", net.host_if)
    run("ip", "link", "set", net.host_if, "up")
    ns = ("ip", "-n", net.netns)
    run(*ns, "addr", "add", f"{net.node_ip}/{net.link_prefix}", "dev", net.node_if)
    run(*ns, "link", "set", net.node_if, "up")
    run(*ns, "link", "set", "lo", "up")
    for cidr in net.routed_cidrs:
        run("ip", "route", "add", cidr, "via", net.node_ip, "dev", net.host_if)
    # Per-namespace settings: forwarding between the bridge and the link, and bridged pod
    # traffic through iptables (a pod answering another through a Service on the same bridge).
    for key in ("net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables"):
        run(*in_node(net, "sysctl", "-qw", f"{key}=1"))
    ipt = in_node(net, "iptables", "-w")
    run(*ipt, "-N", EGRESS_CHAIN)
    for rule in (
        ("-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"),
        ("-d", net.host_ip, "-p", "tcp", "--dport", str(api_port), "-j", "ACCEPT"),
        ("-j", "DROP"),
    ):
        run(*ipt, "-A", EGRESS_CHAIN, *rule)
    for chain in ("FORWARD", "OUTPUT"):
        run(*ipt, "-I", chain, "1", "-o", net.node_if, "-j", EGRESS_CHAIN)
    log.info("node network up netns=%s node_ip=%s host_ip=%s", net.netns, net.node_ip, net.host_ip)


def exists(net: NodeNetwork) -> bool:
    return netns_path(net).exists()


def delete(net: NodeNetwork) -> None:
    """Remove the namespace (its bridge, veths and rules go with it) and the host end if left."""
    if exists(net):
        run("ip", "netns", "del", net.netns)
    if run("ip", "link", "show", net.host_if, check=False).returncode == 0:
        run("ip", "link", "del", net.host_if)
