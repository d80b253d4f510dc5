"""The operator's entry point: `kopf run -m kvrail.operator.main` (never `python -m` from the
repo root: see STYLE.md §3).

Sets Kopf's persistence under the `kopf.kvrail.dev` prefix and puts the API client, the build
context, the settings and the shared etcd/NATS connections into `memo`, where the handlers find
them. Serves the Prometheus metrics when `KVRAIL_OPERATOR_METRICS_PORT` is set.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvrail.operator import handlers, metrics
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.k8s import Kube
from kvrail.operator.planes import Planes
from kvrail.settings import load_settings

PROGRESS_PREFIX = "kopf.kvrail.dev"

__all__ = ["close_connections", "configure_operator", "handlers"]


@kopf.on.startup(id="configure-operator")
def configure_operator(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PROGRESS_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PROGRESS_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{PROGRESS_PREFIX}/finalizer"
    settings.posting.level = logging.INFO
    config = load_settings()
    memo.cluster = Kube.from_environment()
    memo.ctx = BuildContext(
        etcd_endpoints=config.etcd_endpoints,
        nats_url=config.nats_url,
        network_policies=config.operator_network_policies,
    )
    memo.settings = config
    memo.planes = Planes()
    if config.operator_metrics_port is not None:
        metrics.serve(config.operator_metrics_port)


@kopf.on.cleanup(id="close-connections")
async def close_connections(memo: kopf.Memo, **_: Any) -> None:
    planes: Planes | None = memo.get("planes")
    if planes is not None:
        await planes.close()
