"""Every container the operator renders probes paths its process serves, and slow starts are
covered by a startup probe. Found on a real kubelet: the router was probed on the worker's
/readyz and /livez (404 from the router: never Ready), and, without a startup probe, killed by
its liveness probe while it converted its tokenizer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.deployment import build_deployment
from kvrail.operator.builders.meta import (
    ROUTER_LIVE_PATH,
    ROUTER_READY_PATH,
    WORKER_LIVE_PATH,
    WORKER_READY_PATH,
)
from kvrail.operator.builders.statefulset import build_statefulset
from kvrail.operator.testing import make_pool
from kvrail.router.app import RouterState, create_app

CTX = BuildContext()


def container(manifest: dict[str, Any]) -> dict[str, Any]:
    (only,) = manifest["spec"]["template"]["spec"]["containers"]
    return dict(only)


def paths(c: dict[str, Any]) -> dict[str, str]:
    probes = ("readinessProbe", "livenessProbe", "startupProbe")
    return {p: c[p]["httpGet"]["path"] for p in probes if p in c}


def test_the_router_is_probed_on_its_own_paths_with_time_to_load_its_tokenizer() -> None:
    router = container(build_deployment(make_pool(), CTX))
    assert paths(router) == {
        "readinessProbe": ROUTER_READY_PATH,
        "livenessProbe": ROUTER_LIVE_PATH,
        "startupProbe": ROUTER_LIVE_PATH,
    }
    startup = router["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    # The router application serves exactly those paths (the app is only built, not run).
    app = create_app(cast(RouterState, SimpleNamespace(created=1)))
    served = {getattr(route, "path", None) for route in app.routes}
    assert {ROUTER_READY_PATH, ROUTER_LIVE_PATH} <= served


def test_workers_are_probed_on_the_health_ports_paths() -> None:
    for role in ("prefill", "decode"):
        worker = container(build_statefulset(make_pool(), role, CTX))
        assert paths(worker) == {
            "readinessProbe": WORKER_READY_PATH,
            "livenessProbe": WORKER_LIVE_PATH,
            "startupProbe": WORKER_LIVE_PATH,
        }
