"""The operator's entry point: `kopf run -m kvrail.operator.main` (never `python -m` from the
repo root: see STYLE.md §3).

Sets Kopf's persistence under the `kopf.kvrail.dev` prefix and puts the API client and the build
context into `memo`, where the handlers find them.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvrail.operator import handlers
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.k8s import Kube
from kvrail.settings import load_settings

PROGRESS_PREFIX = "kopf.kvrail.dev"

__all__ = ["configure_operator", "handlers"]


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
    memo.ctx = BuildContext(etcd_endpoints=config.etcd_endpoints, nats_url=config.nats_url)
