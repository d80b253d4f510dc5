"""A local pool for tests: real worker and router processes over real etcd and NATS.

`LocalPool` starts each component the production way (`python -P -m kvrail.worker` /
`kvrail.router`, one process each, settings in the environment), waits for its "ready" log line,
kills (-9) or stops it, and asks each worker over its debug subject for its block counts, so a
test can end with "every block on every live worker is free again".
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
import uuid
from pathlib import Path

from nats.aio.client import Client as NatsClient

from kvrail.codec import decode
from kvrail.keys import PoolKeys
from kvrail.local.procs import ManagedProcess
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import BlockCounts, GenerateRequest, WorkerRecord
from kvrail.outputs import TokenEvent, TokenEventBatch
from kvrail.registry import Registry, etcd_client
from kvrail.sampling import SamplingParams
from kvrail.settings import load_settings

READY_TIMEOUT_S = 240.0
_WORKER = [sys.executable, "-P", "-m", "kvrail.worker"]
_ROUTER = [sys.executable, "-P", "-m", "kvrail.router"]


async def flushed(nc: NatsClient) -> None:
    """Every command sent on `nc` so far has reached the server, so another connection sees its
    subscriptions and publishes. Two round trips: nats-py 2.16 writes a flush's PING ahead of the
    commands still pending, so one PONG can come back before the server read them (a CI run of
    test_decode_drain saw none of its requests arrive; a plain nats-py loop of that test lost
    messages in 3 of 300 tries, none with two flushes). The first flush gets them written."""
    await nc.flush()
    await nc.flush()


class LocalPool:
    def __init__(
        self,
        etcd: EtcdServer,
        nats: NatsServer,
        log_dir: Path,
        pool: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.keys = PoolKeys("default", pool)
        servers = {"KVRAIL_POOL": pool, **etcd.client_env(), **nats.client_env()}
        self.settings = load_settings(environ=servers)  # TLS and credentials included
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            **servers,
            "KVRAIL_TORCH_NUM_THREADS": "1",
            **(env or {}),
        }
        self.log_dir = log_dir
        self.procs: dict[str, ManagedProcess] = {}
        self.ready: set[str] = set()
        self.workers: set[str] = set()

    def start(self, worker_id: str, role: str, *args: str, **env: str) -> ManagedProcess:
        """Start worker `worker_id` with `role` (and command-line `args`); `env` adds settings
        for this one."""
        self.workers.add(worker_id)
        argv = [*_WORKER, "--role", role, "--worker-id", worker_id, *args]
        return self._start(worker_id, argv, env)

    def start_router(self, name: str, *args: str, **env: str) -> ManagedProcess:
        return self._start(name, [*_ROUTER, *args], env)

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        generation = sum(1 for _ in self.log_dir.glob(f"{name}.*.log"))
        log_path = self.log_dir / f"{name}.{generation}.log"
        proc = ManagedProcess(name, argv, log_path, env={**self.env, **env})
        self.procs[name] = proc.start()
        self.ready.discard(name)
        return proc

    def wait_ready(self, name: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        proc = self.procs[name]
        marker = "worker ready" if name in self.workers else "router ready"
        proc.wait_ready(lambda: marker in proc.log_path.read_text(), timeout_s, 0.25)
        self.ready.add(name)

    def kill(self, name: str) -> None:
        """kill -9 one process and wait until it is gone."""
        proc = self.procs[name]
        self.ready.discard(name)
        proc.kill()
        deadline = time.monotonic() + 10
        while proc.is_running():
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} survived kill -9")
            time.sleep(0.01)

    def live(self) -> list[str]:
        """Workers that became ready and still run."""
        return [
            n for n, p in self.procs.items() if n in self.ready & self.workers and p.is_running()
        ]

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop(grace_s=20)

    async def records(self) -> dict[str, WorkerRecord]:
        """The pool's worker records in etcd now."""
        async with etcd_client(self.settings) as etcd:
            records, _ = await Registry(etcd, self.keys).workers()
        return records

    async def block_counts(self, nc: NatsClient, worker_id: str) -> BlockCounts:
        reply = await nc.request(self.keys.debug(worker_id), b"", timeout=5)
        return decode(reply.data, BlockCounts)

    async def blocks_held(self, nc: NatsClient, timeout_s: float = 30.0) -> dict[str, BlockCounts]:
        """The live workers that still hold a request, a retained or a quarantined block after
        waiting up to `timeout_s` for every one to be free (polled), with their counts."""
        deadline = time.monotonic() + timeout_s
        held: dict[str, BlockCounts] = {}
        for worker_id in self.live():
            while True:
                c = await self.block_counts(nc, worker_id)
                idle = c.num_requests == c.num_retained == c.num_pending == 0
                if idle and c.num_free_blocks == c.num_blocks:
                    break
                if time.monotonic() > deadline:
                    held[worker_id] = c
                    break
                await asyncio.sleep(0.2)
        return held

    async def assert_all_blocks_free(self, nc: NatsClient, timeout_s: float = 30.0) -> None:
        """Every live worker holds no request, no retained and no quarantined block (polled)."""
        held = await self.blocks_held(nc, timeout_s)
        if held:
            raise AssertionError(f"workers still hold blocks: {held}")


async def generate(
    nc: NatsClient,
    worker_id: str,
    token_ids: tuple[int, ...],
    *,
    keys: PoolKeys,
    max_tokens: int = 8,
    deadline_s: float = 30.0,
    request_id: str | None = None,
    wait: bool = True,
    started: asyncio.Event | None = None,
    sampling: SamplingParams | None = None,
    prefill_worker_id: str = "",
) -> list[TokenEvent]:
    """Send one request to a decode worker as the router would (greedy, no EOS, unless
    `sampling` says otherwise); with `wait`, collect its events until the last, checking they
    come in order (`started` is set at the first)."""
    request_id = request_id or f"req-{uuid.uuid4().hex[:10]}"
    subject = f"test.stream.{request_id}"
    sub = await nc.subscribe(subject)
    request = GenerateRequest(
        request_id=request_id, token_ids=token_ids, stream_subject=subject,
        deadline_unix_s=time.time() + deadline_s,
        sampling=sampling or SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        prefill_worker_id=prefill_worker_id,
    )  # fmt: skip
    await nc.publish(keys.decode_requests(worker_id), request.encode())
    events: list[TokenEvent] = []
    if not wait:
        await sub.unsubscribe()
        return events
    try:
        stop_at = time.monotonic() + deadline_s + 5
        while not events or not events[-1].is_last:
            msg = await sub.next_msg(timeout=max(stop_at - time.monotonic(), 0.01))
            events += [e for e in decode(msg.data, TokenEventBatch).events
                       if e.request_id == request_id]  # fmt: skip
            if started is not None and events:
                started.set()
    finally:
        await sub.unsubscribe()
    assert [e.seq for e in events] == list(range(len(events)))
    return events


def tokens_of(events: list[TokenEvent]) -> list[int]:
    """The generated tokens of a request that ended without an error."""
    assert events[-1].output.error is None, events[-1].output.error
    return [t for e in events for t in e.output.token_ids]


def random_prompt(num_tokens: int, seed: int) -> tuple[int, ...]:
    """`num_tokens` token ids drawn from `seed` (ids of ordinary words in SmolLM2's vocabulary
    range, never its special tokens)."""
    rng = random.Random(seed)
    return tuple(rng.randrange(100, 40_000) for _ in range(num_tokens))
