"""Cluster DNS for the real node: CoreDNS as a Deployment behind the `kube-dns` Service, the
way clusters run it, so pods find Services by name.

It answers for `cluster.local` (and reverse lookups of pods and Services) from the API server
and forwards nothing: there is no resolver beyond this machine to forward to, and pods must not
reach one. Any other name is NXDOMAIN.
"""

from __future__ import annotations

from typing import Any

from kvrail.testing.kubectl import rule
from kvrail.testing.node_config import CLUSTER_DOMAIN, NodeNetwork

NAMESPACE = "kube-system"
NAME = "coredns"
DNS_PORT = 1053  # unprivileged inside the pod; the Service serves 53
LABELS = {"k8s-app": "kube-dns"}

COREFILE = f"""{CLUSTER_DOMAIN}:{DNS_PORT} in-addr.arpa:{DNS_PORT} ip6.arpa:{DNS_PORT} {{
    errors
    health :8080
    ready :8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        pods insecure
        ttl 30
    }}
    cache 30
}}
.:{DNS_PORT} {{
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""
"""The cluster's zones from the API server; every other name does not exist (NXDOMAIN at once,
rather than SERVFAIL after a search for a plugin that could forward it)."""


def manifests(net: NodeNetwork, image: str) -> list[dict[str, Any]]:
    """ServiceAccount, read-only RBAC, the Corefile, the Deployment and the Service."""
    meta = {"namespace": NAMESPACE, "labels": LABELS}
    role = f"system:{NAME}"
    hardened = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    pod = {
        "serviceAccountName": NAME,
        "dnsPolicy": "Default",
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
                "args": ["-conf", "/etc/coredns/Corefile"],
                "ports": [
                    {"name": "dns", "containerPort": DNS_PORT, "protocol": "UDP"},
                    {"name": "dns-tcp", "containerPort": DNS_PORT, "protocol": "TCP"},
                ],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 2},
                "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}},
                "resources": {"requests": {"cpu": "20m", "memory": "32Mi"}},
                "securityContext": hardened,
                "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns"}],
            }
        ],
        "volumes": [{"name": "config", "configMap": {"name": NAME}}],
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, **meta}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": role},
            "rules": [
                rule("", ["services", "pods", "namespaces"], ["list", "watch"]),
                rule("discovery.k8s.io", ["endpointslices"], ["list", "watch"]),
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": role},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": NAME, **meta},
            "data": {"Corefile": COREFILE},
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
            "metadata": {"name": "kube-dns", **meta},
            "spec": {
                "clusterIP": net.dns_ip,
                "selector": LABELS,
                "ports": [
                    {"name": "dns", "port": 53, "targetPort": DNS_PORT, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "targetPort": DNS_PORT, "protocol": "TCP"},
                ],
            },
        },
    ]
