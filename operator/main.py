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
from kvrail.operator.builders.context import DEFAULT_IMAGE, BuildContext, SharedAccess
from kvrail.operator.k8s import Kube
from kvrail.operator.planes import Planes
from kvrail.settings import Settings, load_settings, read_secret

PROGRESS_PREFIX = "kopf.kvrail.dev"

__all__ = ["close_connections", "configure_operator", "handlers", "shared_access"]


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
    etcd_access, nats_access = shared_access(config)
    memo.ctx = BuildContext(
        image=config.operator_image or DEFAULT_IMAGE,
        etcd_endpoints=config.etcd_endpoints,
        nats_url=config.nats_url,
        network_policies=config.operator_network_policies,
        share_access=config.operator_share_access,
        etcd_access=etcd_access,
        nats_access=nats_access,
    )
    memo.settings = config
    memo.planes = Planes()
    if config.operator_metrics_port is not None:
        metrics.serve(config.operator_metrics_port)


def shared_access(config: Settings) -> tuple[SharedAccess, SharedAccess]:
    """The operator's etcd and NATS access from its settings' files, for the pools that use its
    servers (`builders.secret`); empty when `operator_share_access` is off."""
    if not config.operator_share_access:
        return SharedAccess(), SharedAccess()
    return (
        SharedAccess(
            username=config.etcd_username,
            password=read_secret(config.etcd_password_file),
            ca_pem=read_secret(config.etcd_ca_file),
        ),
        SharedAccess(
            username=config.nats_user,
            password=read_secret(config.nats_password_file),
            ca_pem=read_secret(config.nats_ca_file),
        ),
    )


@kopf.on.cleanup(id="close-connections")
async def close_connections(memo: kopf.Memo, **_: Any) -> None:
    planes: Planes | None = memo.get("planes")
    if planes is not None:
        await planes.close()
