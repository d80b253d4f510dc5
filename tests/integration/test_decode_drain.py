"""A decode worker's drain (SIGTERM) against the harness's real NATS: every request already on its
way to the worker when the drain starts gets an answer.

The role runs without an engine: nothing here reaches one (a draining worker refuses new
requests before it would submit them), so its service and transfer parts are stand-ins that
fail the test if used. The node tier's journey found the defect this guards against: a request
sent as its decode pod was deleted got no answer, and its router waited 30-50 s for the worker's
record to leave etcd before it answered 503.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace
from typing import Any

import nats
from nats.aio.msg import Msg

from kvrail.codec import decode
from kvrail.keys import PoolKeys
from kvrail.local.servers import NatsServer
from kvrail.messages import GenerateRequest
from kvrail.outputs import TokenEventBatch
from kvrail.sampling import SamplingParams
from kvrail.testing.pool import flushed
from kvrail.worker.roles.decode import DecodeRole


class _Unused:
    """An engine service or transfer connector the test must never reach."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a draining worker reached its {name}")


def _context(nc: nats.NATS, keys: PoolKeys) -> Any:
    return SimpleNamespace(
        settings=SimpleNamespace(request_timeout_s=60.0), keys=keys, worker_id="decode-0",
        incarnation=1, agent_name="decode-0-1", fingerprint="f" * 64, block_size=16, nc=nc,
        prefill_queue=_Unused(), service=_Unused(),
        connector=SimpleNamespace(region=None, notifications=lambda: []),
        peers=SimpleNamespace(listen=lambda _listener: None),
    )  # fmt: skip


async def test_a_drain_answers_the_requests_sent_before_it_began(nats_server: NatsServer) -> None:
    keys = PoolKeys("default", f"drain-{uuid.uuid4().hex[:8]}")
    worker_nc = await nats.connect(nats_server.url)
    router_nc = await nats.connect(nats_server.url)
    role = DecodeRole(_context(worker_nc, keys))
    # The worker's connection hands messages to its callback one at a time; holding the first
    # keeps the rest in the subscription's queue until the drain has begun. Without the hold the
    # callback may see them first (as a slow CI machine did), and the drain has nothing to do.
    handle, held = role._on_request, asyncio.Event()

    async def on_request(msg: Msg) -> None:
        await held.wait()
        await handle(msg)

    role._on_request = on_request  # type: ignore[method-assign]
    await role.start()
    await flushed(worker_nc)  # the server has the worker's subscriptions
    answers: dict[str, str] = {}
    answered = asyncio.Event()
    ids = [f"r{i}-{uuid.uuid4().hex[:8]}" for i in range(20)]

    async def on_events(msg: Msg) -> None:
        for event in decode(msg.data, TokenEventBatch).events:
            answers[event.request_id] = event.output.error or "tokens"
        if len(answers) == len(ids):
            answered.set()

    inbox = f"_INBOX.{uuid.uuid4().hex}"
    await router_nc.subscribe(f"{inbox}.events", cb=on_events)
    for request_id in ids:
        request = GenerateRequest(request_id, (1, 2, 3), f"{inbox}.events", time.time() + 60,
                                  SamplingParams(max_tokens=4))  # fmt: skip
        await router_nc.publish(keys.decode_requests("decode-0"), request.encode(),
                                reply=f"{inbox}.r.{request_id}")  # fmt: skip
    await flushed(router_nc)  # NATS has routed them all to the worker's connection
    # The drain begins before the worker's connection has handed them to its callback: the
    # moment a SIGTERM that comes with the requests picks.
    drain = asyncio.create_task(role.drain(timeout_s=5.0))
    await asyncio.sleep(0)  # the drain's first step: the worker refuses what comes next
    held.set()
    await drain
    await asyncio.wait_for(answered.wait(), 5.0)
    assert answers == dict.fromkeys(ids, "shutting_down")
    await router_nc.close()
    await worker_nc.close()
