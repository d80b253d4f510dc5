"""The router Deployment: `python -P -m kvrail.router`, stateless, rolled with surge.

The router's settings are its environment (`router_env`), as the workers' are: a settings change
changes the pod template, which rolls the router."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders import placement
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.env import (
    API_KEYS_DIR,
    chat_template_volume,
    infrastructure,
    router_env,
)
from kvrail.operator.builders.meta import (
    ROUTER_LIVE_PATH,
    ROUTER_PORT,
    ROUTER_READY_PATH,
    child_name,
    labels,
    object_meta,
    selector_labels,
)
from kvrail.operator.builders.pod import (
    container_security_context,
    image,
    pod_common,
    probes,
    scratch_volumes,
)

ROUTER_COMMAND = ["python", "-P", "-m", "kvrail.router"]


def router_volumes(
    pool: InferencePool, ctx: BuildContext, scratch: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) of a process running the router's code (the router, the
    endpoint picker, a pod's HTTP front): cache and /tmp when `scratch`, etcd and NATS
    credentials, the API keys and the chat template."""
    _, secret_volumes, secret_mounts = infrastructure(pool, ctx)
    volumes, mounts = scratch_volumes(shm=False) if scratch else ([], [])
    volumes += secret_volumes
    mounts += secret_mounts
    keys = pool.spec.security.api_keys_secret
    if keys:
        volumes.append({"name": "api-keys", "secret": {"secretName": keys, "defaultMode": 0o440}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    template_volumes, template_mounts = chat_template_volume(pool)
    volumes += template_volumes
    mounts += template_mounts
    return volumes, mounts


def surge_one() -> dict[str, Any]:
    """A Deployment's rollout that brings a new pod up before an old one goes (router, EPP)."""
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def add_resources(container: dict[str, Any], resources: BaseModel) -> None:
    """The container's requests and limits from a spec's `resources`, where it sets any."""
    given = {k: dict(v) for k, v in resources.model_dump().items() if v}
    if given:
        container["resources"] = given


def build_deployment(pool: InferencePool, ctx: BuildContext) -> dict[str, Any]:
    volumes, mounts = router_volumes(pool, ctx)
    env = router_env(pool, ctx)
    router = pool.spec.router
    container = {
        "name": "router",
        "image": image(pool, ctx),
        "imagePullPolicy": pool.spec.image_pull_policy,
        "command": list(ROUTER_COMMAND),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": env,
        "securityContext": container_security_context([]),
        "volumeMounts": mounts,
        **probes(slow_start=True, ready_path=ROUTER_READY_PATH, live_path=ROUTER_LIVE_PATH),
    }
    add_resources(container, router.resources)
    template_meta = {"labels": labels(pool, "router")}
    spread = placement.topology_spread(pool, "decode")
    spread[0]["labelSelector"] = {"matchLabels": selector_labels(pool, "router")}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(pool, child_name(pool, "router"), "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector_labels(pool, "router")},
            "strategy": surge_one(),
            "template": {
                "metadata": template_meta,
                "spec": {
                    **pod_common(pool),
                    "terminationGracePeriodSeconds": 30,
                    "containers": [container],
                    "volumes": volumes,
                    "topologySpreadConstraints": spread,
                },
            },
        },
    }
