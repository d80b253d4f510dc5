"""Gateway API Inference Extension (GAIE) mode: the GAIE InferencePool, kvrail's endpoint picker
(EPP) and each decode pod's HTTP front.

With `spec.router.gateway.inferenceExtension.enabled`, a GAIE gateway sends each request through
the EPP (`python -P -m kvrail.epp`, an Envoy ext_proc service), which names the decode pod that
kvrail's router would choose; the gateway then sends the request to that pod's HTTP front (the
router's code pinned to the pod's own worker). The objects:

- `<pool>-gaie`, an `inference.networking.k8s.io/v1` `InferencePool`: the decode pods (selector)
  on the front's port (`targetPorts`), picked by `<pool>-epp` (`endpointPickerRef`) with the
  spec's `failureMode`. The operator never writes its status: each gateway writes its own entry
  of `status.parents`, and server-side apply of a manifest without `status` leaves it alone.
- `<pool>-epp`, a Deployment and a Service. The EPP reads etcd and NATS as the router does, with
  the router's environment; it never calls the Kubernetes API, so it has no RBAC and no
  ServiceAccount token. Its gRPC health (`liveness`, `readiness`) is served on the ext_proc port.
- in each decode pod, the container `front` (`kvrail.router --pin-worker <pod name>`, the worker
  id being the pod's name) on `FRONT_PORT`, and the worker's `--http-front <pod IP>:FRONT_PORT`,
  which advertises it in the worker's etcd record.
"""

from __future__ import annotations

from typing import Any, Final

from kvrail.crd.gateway import InferenceExtensionSpec
from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.deployment import add_resources, router_volumes, surge_one
from kvrail.operator.builders.env import CACHE_DIR, router_env, setting
from kvrail.operator.builders.meta import (
    ROUTER_LIVE_PATH,
    ROUTER_PORT,
    ROUTER_READY_PATH,
    child_name,
    labels,
    object_meta,
    selector_labels,
)
from kvrail.operator.builders.pod import container_security_context, http_probe, image, pod_common

GAIE_GROUP: Final = "inference.networking.k8s.io"
GAIE_API_VERSION: Final = f"{GAIE_GROUP}/v1"
GAIE_KIND: Final = "InferencePool"
FRONT_PORT: Final = ROUTER_PORT
"""A decode pod's HTTP front: the router's port, in the pod (the worker's own is 8080)."""
FRONT_PORT_NAME: Final = "front"
EPP_PORT: Final = 9002
"""The EPP's ext_proc port, TLS with a self-signed certificate, which GAIE's gateways connect to
without verifying it (`kvrail.epp`'s defaults, as GAIE's own picker)."""
EPP_TLS_DIR: Final = "/etc/kvrail/epp-tls"
"""Where `inferenceExtension.tlsSecret` is mounted (`--cert-path`)."""
EPP_HEALTH_PORT: Final = 9003
"""The EPP's gRPC health in plaintext, for the kubelet's gRPC probes (which speak no TLS)."""
EPP_METRICS_PORT: Final = 9090
"""The EPP's Prometheus `/metrics` over HTTP (`kvrail.epp`'s default, as GAIE's EPPs)."""
EPP_COMMAND: Final = ["python", "-P", "-m", "kvrail.epp"]
FRONT_COMMAND: Final = ["python", "-P", "-m", "kvrail.router", "--pin-worker"]
POD_NAME_VAR: Final = "$(KVRAIL_POD_NAME)"
POD_IP_VAR: Final = "$(KVRAIL_POD_IP)"
"""Expanded by the kubelet from the container's own downward-API variables (`identity_env`)."""


def inference_extension(pool: InferencePool) -> InferenceExtensionSpec | None:
    """The pool's GAIE settings when the mode is on, else None."""
    gateway = pool.spec.router.gateway
    if gateway is None or not gateway.inference_extension.enabled:
        return None
    return gateway.inference_extension


def gaie_pool_name(pool: InferencePool) -> str:
    """`<pool>-gaie`: the GAIE InferencePool and its HTTPRoute."""
    return f"{pool.metadata.name}-gaie"


def front_args() -> list[str]:
    """The worker's arguments that advertise the pod's front in its etcd record."""
    return ["--http-front", f"{POD_IP_VAR}:{FRONT_PORT}"]


def build_gaie_pool(pool: InferencePool) -> dict[str, Any]:
    """The GAIE InferencePool over the decode pods' fronts, picked by kvrail's EPP."""
    gaie = inference_extension(pool)
    if gaie is None:
        raise ValueError(f"pool {pool.metadata.name} is not in GAIE mode")
    return {
        "apiVersion": GAIE_API_VERSION,
        "kind": GAIE_KIND,
        "metadata": object_meta(pool, gaie_pool_name(pool), None),
        "spec": {
            "selector": {"matchLabels": selector_labels(pool, "decode")},
            "targetPorts": [{"number": FRONT_PORT}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": child_name(pool, "epp"),
                "port": {"number": EPP_PORT},
                "failureMode": gaie.failure_mode,
            },
        },
    }


def build_epp_service(pool: InferencePool) -> dict[str, Any]:
    """ClusterIP: the gateway's ext_proc cluster (gRPC over TLS); and the EPP's metrics (HTTP),
    for a ServiceMonitor."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pool, child_name(pool, "epp"), "epp"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(pool, "epp"),
            "ports": [
                {
                    "name": "grpc",
                    "port": EPP_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "http2",
                },
                {
                    "name": "metrics",
                    "port": EPP_METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }


def _grpc_probe(service: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "grpc": {"port": EPP_HEALTH_PORT, "service": service},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def build_epp_deployment(pool: InferencePool, ctx: BuildContext) -> dict[str, Any]:
    """The EPP: the router's environment and volumes (it loads the tokenizer, never weights),
    gRPC probes, no Kubernetes API access."""
    gaie = inference_extension(pool)
    if gaie is None:
        raise ValueError(f"pool {pool.metadata.name} is not in GAIE mode")
    volumes, mounts = router_volumes(pool, ctx)
    tls: list[str] = []
    if gaie.tls_secret:  # mounted, so a rotated Secret reaches the picker without a restart
        secret = {"secretName": gaie.tls_secret, "defaultMode": 0o440}
        volumes.append({"name": "epp-tls", "secret": secret})
        mounts.append({"name": "epp-tls", "mountPath": EPP_TLS_DIR, "readOnly": True})
        tls = ["--cert-path", EPP_TLS_DIR]
    container: dict[str, Any] = {
        "name": "epp",
        "image": image(pool, ctx),
        "imagePullPolicy": pool.spec.image_pull_policy,
        "command": [
            *EPP_COMMAND,
            "--port",
            str(EPP_PORT),
            "--num-endpoints",
            str(gaie.num_endpoints),
            "--health-port",
            str(EPP_HEALTH_PORT),
            "--metrics-port",
            str(EPP_METRICS_PORT),
            *tls,
        ],
        "ports": [
            {"name": "grpc", "containerPort": EPP_PORT, "protocol": "TCP"},
            {"name": "health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "env": router_env(pool, ctx),
        "securityContext": container_security_context([]),
        "volumeMounts": mounts,
        "readinessProbe": _grpc_probe("readiness", 5, 3),
        "livenessProbe": _grpc_probe("liveness", 10, 3),
        "startupProbe": _grpc_probe("liveness", 10, 60),
    }
    add_resources(container, gaie.resources)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(pool, child_name(pool, "epp"), "epp"),
        "spec": {
            "replicas": gaie.epp_replicas,
            "selector": {"matchLabels": selector_labels(pool, "epp")},
            "strategy": surge_one(),
            "template": {
                "metadata": {"labels": labels(pool, "epp")},
                "spec": {
                    **pod_common(pool),
                    "terminationGracePeriodSeconds": 40,  # the EPP's 30 s for open streams
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def front_container(
    pool: InferencePool, ctx: BuildContext
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the decode pod's `front` container, the volumes it adds to the pod). Its cache and /tmp
    are its own (the worker writes the model's cache beside it); credential volumes are the
    worker's, by the same names."""
    volumes, mounts = router_volumes(pool, ctx, scratch=False)
    volumes = [v for v in volumes if v["name"] in ("api-keys", "chat-template")]
    volumes += [{"name": "front-cache", "emptyDir": {}}, {"name": "front-tmp", "emptyDir": {}}]
    mounts += [
        {"name": "front-cache", "mountPath": CACHE_DIR},
        {"name": "front-tmp", "mountPath": "/tmp"},
    ]
    env = [e for e in router_env(pool, ctx)
           if e["name"] not in ("KVRAIL_HTTP_PORT", "KVRAIL_ROUTER_HOST")]  # fmt: skip
    # The pod's own address, IPv4 or IPv6 (0.0.0.0 would leave an IPv6 pod's front unreachable);
    # the gateway and the kubelet's probes both come to it.
    env += [setting("router_host", POD_IP_VAR), setting("http_port", FRONT_PORT)]
    container = {
        "name": "front",
        "image": image(pool, ctx),
        "imagePullPolicy": pool.spec.image_pull_policy,
        "command": [*FRONT_COMMAND, POD_NAME_VAR],
        "ports": [{"name": FRONT_PORT_NAME, "containerPort": FRONT_PORT, "protocol": "TCP"}],
        "env": env,
        "securityContext": container_security_context([]),
        "volumeMounts": mounts,
        "readinessProbe": http_probe(ROUTER_READY_PATH, FRONT_PORT_NAME, 5, 3),
        "livenessProbe": http_probe(ROUTER_LIVE_PATH, FRONT_PORT_NAME, 10, 3),
        "startupProbe": http_probe(ROUTER_LIVE_PATH, FRONT_PORT_NAME, 10, 60),
    }
    return container, volumes
