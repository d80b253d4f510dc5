"""A real Gateway API implementation for the real node: Traefik, installed the way a platform
team installs it, with its GatewayClass; and the addresses a cloud would give LoadBalancer
Services.

Traefik runs as a Deployment with the kubernetesgateway provider: it watches Gateways of class
`traefik` and their HTTPRoutes, proxies to the routes' endpoints, and reports the address of its
LoadBalancer Service in each Gateway's status. A Gateway's listener port must be one of Traefik's
entry points: `web` is 8000, the Service's port 80 in front of it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kvrail.testing.kubectl import KubectlError, kubectl, rule
from kvrail.testing.node_config import NodeNetwork

log = logging.getLogger(__name__)

NAMESPACE = "traefik-system"
NAME = "traefik"
GATEWAY_CLASS = "traefik"
CONTROLLER_NAME = "traefik.io/gateway-controller"
GATEWAY_GROUP = "gateway.networking.k8s.io"
WEB_PORT = 8000
"""The entry point a Gateway listener names with `port: 8000`."""
LABELS = {"app.kubernetes.io/name": NAME}
_GATEWAY_KINDS = ("gatewayclasses", "gateways", "httproutes", "grpcroutes", "tcproutes",
                  "tlsroutes", "referencegrants", "backendtlspolicies")  # fmt: skip


def traefik_args() -> list[str]:
    return [
        f"--entryPoints.web.address=:{WEB_PORT}",
        "--entryPoints.traefik.address=:9000",
        "--ping=true",
        "--providers.kubernetesgateway=true",
        f"--providers.kubernetesgateway.statusaddress.service.name={NAME}",
        f"--providers.kubernetesgateway.statusaddress.service.namespace={NAMESPACE}",
        "--global.checkNewVersion=false",
        "--global.sendAnonymousUsage=false",
        "--log.level=INFO",
        "--log.noColor=true",
    ]


def manifests(image: str) -> list[dict[str, Any]]:
    """Namespace, ServiceAccount, Traefik's documented Gateway RBAC (read, plus status
    updates), the Deployment, its LoadBalancer Service and the GatewayClass."""
    meta = {"namespace": NAMESPACE, "labels": LABELS}
    rbac = "rbac.authorization.k8s.io"
    pod = {
        "serviceAccountName": NAME,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": NAME,
                "image": image,
                "imagePullPolicy": "Never",
                "args": traefik_args(),
                "ports": [
                    {"name": "web", "containerPort": WEB_PORT},
                    {"name": "traefik", "containerPort": 9000},
                ],
                "readinessProbe": {"httpGet": {"path": "/ping", "port": 9000}, "periodSeconds": 2},
                "livenessProbe": {"httpGet": {"path": "/ping", "port": 9000}},
                "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, **meta}},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRole",
            "metadata": {"name": f"{NAME}-gateway"},
            "rules": [
                rule("", ["namespaces"], ["list", "watch"]),
                rule("", ["services", "secrets", "configmaps"], ["get", "list", "watch"]),
                rule("discovery.k8s.io", ["endpointslices"], ["list", "watch"]),
                rule(GATEWAY_GROUP, list(_GATEWAY_KINDS), ["get", "list", "watch"]),
                rule(GATEWAY_GROUP, [f"{k}/status" for k in _GATEWAY_KINDS], ["update"]),
            ],
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{NAME}-gateway"},
            "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": f"{NAME}-gateway"},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": NAME, **meta},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": LABELS},
                "template": {"metadata": {"labels": LABELS}, "spec": pod},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": NAME, **meta},
            "spec": {
                "type": "LoadBalancer",
                "selector": LABELS,
                "ports": [{"name": "web", "port": 80, "targetPort": "web"}],
            },
        },
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "GatewayClass",
            "metadata": {"name": GATEWAY_CLASS},
            "spec": {"controllerName": CONTROLLER_NAME},
        },
    ]


def assign_load_balancers(kubeconfig: Path, net: NodeNetwork) -> dict[str, str]:
    """What a cloud's load-balancer controller does: every LoadBalancer Service without an
    address gets the next free one of `net.lb_cidr` in its status, which kube-proxy then serves
    on the node (the host routes that range there). Returns namespace/name -> address."""
    services = yaml.safe_load(kubectl(kubeconfig, "get", "services", "-A", "-o", "json"))
    lbs = [s for s in services["items"] if s["spec"].get("type") == "LoadBalancer"]
    used = {
        ing.get("ip")
        for s in lbs
        for ing in s.get("status", {}).get("loadBalancer", {}).get("ingress", [])
    }
    free = (str(ip) for ip in ipaddress.ip_network(net.lb_cidr).hosts() if str(ip) not in used)
    out = {}
    for s in lbs:
        meta = s["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        ingress = s.get("status", {}).get("loadBalancer", {}).get("ingress", [])
        if ingress:
            out[key] = ingress[0]["ip"]
            continue
        ip = next(free)
        patch = {"status": {"loadBalancer": {"ingress": [{"ip": ip, "ipMode": "VIP"}]}}}
        kubectl(kubeconfig, "patch", "service", meta["name"], "-n", meta["namespace"],
                "--subresource=status", "--type=merge", "-p", json.dumps(patch))  # fmt: skip
        out[key] = ip
    return out


@contextlib.contextmanager
def load_balancer_controller(
    kubeconfig: Path, net: NodeNetwork, period_s: float = 1.0
) -> Iterator[None]:
    """`assign_load_balancers` every `period_s` in a thread while the block runs, as a cloud's
    controller keeps doing: for the Services a gateway makes after the cluster came up (Envoy
    Gateway makes one per Gateway, and its Gateways are Programmed only once it has an address)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(period_s):
            try:
                assign_load_balancers(kubeconfig, net)
            except (KubectlError, subprocess.TimeoutExpired) as err:  # tried again next time
                log.warning("load balancer assignment failed: %s", err)

    thread = threading.Thread(target=run, name="load-balancers", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)
