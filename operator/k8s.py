"""The only module of the operator that calls the Kubernetes API.

A thin, synchronous wrapper over the dynamic client (Kopf runs sync handlers in its thread pool):
server-side apply, get and delete of any kind by apiVersion and kind. Errors are the dynamic
client's (`DynamicApiError` subclasses with `.status`); a kind the server does not serve (no
Gateway API installed) raises `KindNotServedError`. Tested against a real kube-apiserver in
`tests/e2e/`.

Discovery is resolved once per kind, under a lock: the dynamic client's discovery cache is not
thread-safe (concurrent handlers rebuilding it raise `KeyError`), and it rediscovers the whole API
on every miss, so an absent kind (HTTPRoute without the Gateway API) is remembered for
`NEGATIVE_TTL_S` instead of costing a full discovery per reconcile. The dynamic client also keeps
its discovery in a file under the temp dir, shared by every process that talks to the same API
server, so a kind can be known that the server no longer serves (its CRD deleted since): a server-
side apply answered 404 (which it never is for an object: it creates) rediscovers once, and the
kind is then reported as not served if it is gone.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kubernetes import client, config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

FIELD_MANAGER = "kvrail-operator"
PLANNER_FIELD_MANAGER = "kvrail-planner"
NEGATIVE_TTL_S = 30.0


class KindNotServedError(Exception):
    """The API server does not serve this apiVersion and kind (its CRD is not installed)."""


class Kube:
    """Apply, get and delete objects in one cluster."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._dynamic = DynamicClient(api_client)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()
        self._resources: dict[tuple[str, str], tuple[float, Any]] = {}

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster config (the operator's ServiceAccount), else the local kubeconfig."""
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        return cls(client.ApiClient())

    def _resource(self, api_version: str, kind: str) -> Any:
        key = (api_version, kind)
        with self._lock:
            now = time.monotonic()
            cached = self._resources.get(key)
            if cached is not None and (cached[1] is not None or now - cached[0] < NEGATIVE_TTL_S):
                resource = cached[1]
            else:
                try:
                    resource = self._dynamic.resources.get(api_version=api_version, kind=kind)
                except ResourceNotFoundError:
                    resource = None
                self._resources[key] = (now, resource)
        if resource is None:
            raise KindNotServedError(f"{kind}.{api_version} is not served")
        return resource

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager, taking over conflicting fields."""
        api_version, kind = manifest["apiVersion"], manifest["kind"]
        try:
            return self._apply(self._resource(api_version, kind), manifest)
        except NotFoundError:  # discovered from a stale cache: the kind may be gone
            with self._lock:
                self._dynamic.resources.invalidate_cache()
                self._resources.pop((api_version, kind), None)
            return self._apply(self._resource(api_version, kind), manifest)

    @staticmethod
    def _apply(resource: Any, manifest: dict[str, Any]) -> dict[str, Any]:
        result = resource.server_side_apply(
            body=manifest,
            namespace=manifest["metadata"].get("namespace"),
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )
        return result.to_dict()  # type: ignore[no-any-return]

    def get(self, api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        """The object, or None when it (or its kind) does not exist."""
        try:
            resource = self._resource(api_version, kind)
            return resource.get(name=name, namespace=namespace).to_dict()  # type: ignore[no-any-return]
        except (NotFoundError, KindNotServedError):
            return None

    def delete(self, api_version: str, kind: str, name: str, namespace: str) -> bool:
        """Delete in the foreground; False when there was nothing to delete."""
        try:
            resource = self._resource(api_version, kind)
            resource.delete(
                name=name, namespace=namespace, body={"propagationPolicy": "Foreground"}
            )
        except (NotFoundError, KindNotServedError):
            return False
        return True

    def scale(self, api_version: str, kind: str, name: str, namespace: str, replicas: int) -> None:
        """Set replicas through the scale subresource (as an HPA does), as the planner's field
        manager; NotFoundError when the object does not exist."""
        resource = self._resource(api_version, kind)
        resource.subresources["scale"].patch(
            name=name,
            namespace=namespace,
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
            field_manager=PLANNER_FIELD_MANAGER,
        )
