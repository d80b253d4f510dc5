"""The real node is a real cluster network that reaches nothing else: a pod finds Services by
name through CoreDNS and reaches the API server through the `kubernetes` Service, and nothing
beyond the node: no route out of its namespace, no other port of the host, no name resolved
outside the cluster (CoreDNS forwards nowhere). Only addresses the harness made are dialled."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
import yaml

from kvrail.testing.cluster_checks import get_json
from kvrail.testing.kubectl import kubectl
from kvrail.testing.operator_process import wait_for
from kvrail.testing.real_cluster import RealCluster

pytestmark = [pytest.mark.node]

PROBE = """
import json, socket, sys, time
def again(err, attempt):
    # EAI_AGAIN: the resolver had no answer in time (a query lost on a busy node); tried again
    if isinstance(err, socket.gaierror) and err.errno == socket.EAI_AGAIN and attempt < 4:
        time.sleep(1)
        return True
    return False
def tcp(host, port):
    for attempt in range(5):
        s = socket.socket()
        s.settimeout(3)
        try:
            s.connect((host, port))
            return "open"
        except socket.timeout:
            return "timeout"
        except OSError as err:
            if not again(err, attempt):
                return f"refused:{err.errno}"
        finally:
            s.close()
def resolve(name, retry=True):
    for attempt in range(5):
        try:
            return socket.gethostbyname(name)
        except OSError as err:
            if not (retry and again(err, attempt)):
                return None
host, api_port, other_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print(json.dumps({
    "api_server": tcp("kubernetes.default.svc", 443),
    "api_server_direct": tcp(host, api_port),
    "host_other_port": tcp(host, other_port),
    "kubernetes": resolve("kubernetes.default.svc.cluster.local"),
    "outside_name": resolve("pypi.org", retry=False),
}))
"""


def test_pods_reach_services_by_name_and_the_api_server_and_nothing_beyond_the_node(
    real_cluster: RealCluster,
) -> None:
    net, kc = real_cluster.node.net, real_cluster.kubeconfig
    routes = subprocess.run(["ip", "-n", net.netns, "route", "show", "default"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    assert routes.stdout.strip() == "", "the node has a default route out"
    # A listener on the host end of the node's link, which pods must not reach.
    with socket.socket() as listener:
        listener.bind((net.host_ip, 0))
        listener.listen()
        other_port = listener.getsockname()[1]
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "isolation-probe", "namespace": "default"},
            "spec": {
                "restartPolicy": "Never",
                "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
                "containers": [{
                    "name": "probe", "image": real_cluster.kvrail_image,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-P", "-c", PROBE, net.host_ip,
                                str(real_cluster.plane.port), str(other_port)],
                }],
            },
        }  # fmt: skip
        kubectl(kc, "apply", "-f", "-", stdin=yaml.safe_dump(pod))
        try:
            wait_for(
                "the probe pod done",
                lambda: (
                    get_json(kc, "pod", "isolation-probe")["status"].get("phase")
                    in ("Succeeded", "Failed")
                ),
                120,
                1,
            )
            result = json.loads(kubectl(kc, "logs", "isolation-probe").strip().splitlines()[-1])
        finally:
            kubectl(kc, "delete", "pod", "isolation-probe", "--wait=true")
    assert result == {
        "api_server": "open",
        "api_server_direct": "open",
        "host_other_port": "timeout",
        "kubernetes": "10.96.0.1",
        "outside_name": None,
    }
