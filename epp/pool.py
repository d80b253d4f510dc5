"""A kvrail pool as the EPP follows it: the router's state, built as the router builds it.

:func:`follow_pool` loads the model's tokenizer (never its weights), connects to the pool's etcd
and NATS from the same ``Settings`` a router of the pool reads (``KVRAIL_*``), starts a
``WorkerView`` and builds the ``Dispatcher`` with the router's chooser (policy and scorers), so
:class:`~kvrail.epp.kv_picker.KvAwarePicker` scores workers exactly as the pool's routers do.
Nothing here serves HTTP or sends a request to a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kvrail.bus import connect
from kvrail.keys import PoolKeys
from kvrail.registry import Registry, etcd_client
from kvrail.router.__main__ import chooser
from kvrail.router.discovery.view import WorkerView
from kvrail.router.generate import RouterState
from kvrail.router.metrics import RouterMetrics
from kvrail.router.streams.dispatcher import Dispatcher
from kvrail.router.tenants import Admission, TenantTable
from kvrail.router.text.chat_template import template_file
from kvrail.router.text.tokenizer import TextCodec
from kvrail.settings import Settings

READY_TIMEOUT_S = 30.0


@contextlib.asynccontextmanager
async def follow_pool(settings: Settings) -> AsyncIterator[RouterState]:
    """The router state of the pool ``settings`` name, its view following etcd and NATS until
    the context exits. Raises ConfigError (a bad routing profile, an unreadable keys file),
    ModelNotFoundError, DeadlineExceededError (etcd not read in ``READY_TIMEOUT_S``)."""
    policy = chooser(settings)
    tenants = TenantTable.load(settings.api_keys_file)
    template = template_file(settings.chat_template) if settings.chat_template else None
    codec = await asyncio.to_thread(TextCodec.load, settings.model, settings.cache_dir, template)
    keys = PoolKeys(settings.namespace, settings.pool)
    nc = await connect(settings, name=f"kvrail-epp-{settings.pod_name or 'local'}")
    etcd = etcd_client(settings)
    try:
        view = WorkerView(Registry(etcd, keys), nc, keys)
        await view.start()
        try:
            await view.wait_until(view.ready.is_set, READY_TIMEOUT_S)
            dispatcher = Dispatcher(nc, keys, view, policy, settings.block_size)
            yield RouterState(
                codec=codec, dispatcher=dispatcher, view=view, tenants=tenants,
                admission=Admission(), metrics=RouterMetrics(),
                served_name=settings.served_model_name or codec.served_name,
                max_model_len=settings.max_model_len or 0,
                request_timeout_s=settings.request_timeout_s,
                allow_special_tokens=settings.allow_special_tokens_in_prompts,
            )  # fmt: skip
        finally:
            await view.stop()
    finally:
        await nc.drain()
        await etcd.close()
