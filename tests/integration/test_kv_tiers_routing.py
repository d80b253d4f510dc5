"""KV tiers across the pool, over real etcd and NATS: a worker's real `KvEventPublisher` tells
the router's `WorkerView` which block is in which tier; the router counts them per tier, gets
them back whole from a kv_state reply after a gap, forgets them all when the worker's lease
goes, and names the prefill worker holding a prompt's prefix for its remote prefill.

The engine's tiers land elsewhere: the changes fed here are `KvChanges` as the engine hands them
over (`tier="host"`/`"disk"`), through the worker's own publisher.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from kvrail.keys import PoolKeys
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import KvEvent, KvTier, KvTierState, WorkerRecord, WorkerRole
from kvrail.registry import Registration, Registry, etcd_client
from kvrail.router.discovery.index import PrefixMatch, prompt_hashes
from kvrail.router.discovery.view import WorkerView
from kvrail.router.policy import Chooser, Decision
from kvrail.router.streams.dispatcher import Dispatcher, Job
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings
from kvrail.tasks import cancel_and_wait
from kvrail.testing.pool import flushed
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.roles.kv_events import KvEventPublisher

FINGERPRINT = "e" * 64
BLOCK_SIZE = 4
WAIT_S = 10.0
TOKENS = tuple(range(40))  # 10 blocks
PROMPT = prompt_hashes(TOKENS, BLOCK_SIZE, FINGERPRINT)


@dataclass
class Pool:
    registry: Registry
    nc: NatsClient
    keys: PoolKeys
    view: WorkerView
    nats_url: str


@pytest.fixture
async def pool(etcd_server: EtcdServer, nats_server: NatsServer) -> AsyncIterator[Pool]:
    keys = PoolKeys("default", f"kt-{uuid.uuid4().hex[:8]}")
    client = etcd_client(Settings(etcd_endpoints=(etcd_server.endpoint,)))
    async with client:
        nc = await nats.connect(nats_server.url)
        registry = Registry(client, keys)
        view = WorkerView(registry, nc, keys, state_timeout_s=0.5, retry_initial_s=0.05,
                          retry_max_s=0.2)  # fmt: skip
        try:
            yield Pool(registry, nc, keys, view, nats_server.url)
        finally:
            await view.stop()
            await registry.delete_pool()
            await nc.close()


@dataclass
class Worker:
    """One worker's KV-event side as the worker process wires it: its own NATS connection,
    a real publisher, and its record under a lease."""

    nc: NatsClient
    publisher: KvEventPublisher
    registration: Registration

    def changes(self, tier: KvTier, stored: range = range(0), removed: range = range(0)) -> None:
        self.publisher.on_changes(
            KvChanges(stored=tuple(bytes.fromhex(PROMPT[i]) for i in stored),
                      removed=tuple(bytes.fromhex(PROMPT[i]) for i in removed), tier=tier)
        )  # fmt: skip

    async def stop(self) -> None:
        await self.publisher.close()
        await self.registration.close()
        await self.nc.close()


async def start_worker(
    pool: Pool, worker_id: str, role: WorkerRole = "decode", ttl_s: int = 3
) -> Worker:
    nc = await nats.connect(pool.nats_url)
    publisher = KvEventPublisher(nc, pool.keys, worker_id, incarnation=1)
    await publisher.start()
    await flushed(nc)
    record = WorkerRecord(worker_id=worker_id, pod_uid=f"uid-{worker_id}", incarnation=1,
                          role=role, fingerprint=FINGERPRINT, block_size=BLOCK_SIZE,
                          is_ready=True)  # fmt: skip
    registration = await pool.registry.register(record, ttl_s=ttl_s)
    return Worker(nc, publisher, registration)


def matches(pool: Pool) -> dict[str, tuple[int, int, int]]:
    return {
        c.worker_id: (c.matched_blocks, c.num_host_blocks, c.num_disk_blocks)
        for c in pool.view.candidates(PROMPT)
    }


async def until(pool: Pool, predicate: Callable[[], bool]) -> None:
    await pool.view.wait_until(predicate, WAIT_S)


async def test_a_worker_s_tiers_reach_the_router_by_events_and_by_its_kv_state(
    pool: Pool,
) -> None:
    worker = await start_worker(pool, "d-0")
    worker.changes("gpu", stored=range(0, 6))
    worker.changes("host", stored=range(0, 8))  # written behind: blocks 0-5 in both
    worker.changes("gpu", removed=range(2, 6))  # the GPU evicted 2-5: the host keeps them
    await pool.view.start()  # a router starting now: the kv_state reply carries every tier
    await pool.view.wait_for_workers(1, WAIT_S, with_state=True)
    assert matches(pool) == {"d-0": (8, 6, 0)}
    assert pool.view.index.num_hashes("d-0", "host") == 8
    worker.changes("disk", stored=range(6, 10))  # live events, each of its own tier
    worker.changes("host", removed=range(6, 8))
    await until(pool, lambda: matches(pool) == {"d-0": (10, 4, 4)})
    assert pool.view.index.last_seq("d-0") == worker.publisher.event_log.seq == 5
    # A lost event (the router's index is out of step) is healed by a fetch of every tier.
    worker.publisher.event_log.events_for(KvChanges(removed=(bytes.fromhex(PROMPT[0]),)))
    worker.changes("disk", removed=range(9, 10))  # seq 7 after a seq 6 nobody saw: a gap
    await until(pool, lambda: pool.view.index.last_seq("d-0") == 7)
    # Block 0 left the GPU: the engine would load 0-5 from the host (block 1 too, though it is
    # in GPU memory: its GPU run ended at block 0) and 6-8 from disk.
    assert matches(pool) == {"d-0": (9, 6, 3)}
    await worker.stop()


async def test_a_worker_whose_lease_runs_out_is_forgotten_in_every_tier(pool: Pool) -> None:
    """As after kill -9: no more lease refreshes, no goodbye on NATS."""
    dead = await start_worker(pool, "d-0", ttl_s=2)
    alive = await start_worker(pool, "d-1")
    for worker in (dead, alive):
        worker.changes("gpu", stored=range(0, 2))
        worker.changes("host", stored=range(2, 5))
        worker.changes("disk", stored=range(5, 7))
    await pool.view.start()
    await pool.view.wait_for_workers(2, WAIT_S, with_state=True)
    assert matches(pool) == {"d-0": (7, 3, 2), "d-1": (7, 3, 2)}
    assert dead.registration._task is not None
    await cancel_and_wait(dead.registration._task)  # the process is gone: its lease lapses
    await dead.nc.close()
    await until(pool, lambda: "d-0" not in pool.view.records())
    assert pool.view.index.workers() == {"d-1"}
    assert pool.view.index.match_tiers(PROMPT) == {"d-1": PrefixMatch(7, 3, 2)}
    assert all(pool.view.index.num_hashes("d-0", t) == 0 for t in ("gpu", "host", "disk"))
    await alive.stop()


async def test_the_prefill_worker_holding_more_of_the_prefix_is_named_for_the_prefill(
    pool: Pool,
) -> None:
    decode = await start_worker(pool, "d-0")
    holder = await start_worker(pool, "p-0", role="prefill")
    other = await start_worker(pool, "p-1", role="prefill")
    decode.changes("gpu", stored=range(0, 2))
    holder.changes("gpu", stored=range(0, 3))
    holder.changes("host", stored=range(3, 9))  # most of the prompt, in host memory
    other.changes("gpu", stored=range(0, 1))
    await pool.view.start()
    await pool.view.wait_for_workers(1, WAIT_S, with_state=True)
    await until(pool, lambda: pool.view.has_state("p-0") and pool.view.has_state("p-1"))
    by_id = {
        c.worker_id: (c.matched_blocks, c.num_host_blocks)
        for c in pool.view.prefill_candidates(hashes=PROMPT)
    }
    assert by_id == {"p-0": (9, 6), "p-1": (1, 0)}
    dispatcher = Dispatcher(pool.nc, pool.keys, pool.view, Chooser("kv-aware"), BLOCK_SIZE)
    job = Job("r-1", TOKENS, SamplingParams(max_tokens=4), time.time() + 10)
    decision = dispatcher.choose(job, set())
    assert (decision.worker_id, decision.matched_blocks) == ("d-0", 2)  # no prefill worker
    assert dispatcher.prefill_worker_for(job, decision) == "p-0"
    # A decode worker holding as much as any prefill worker: the queue decides.
    assert dispatcher.prefill_worker_for(job, Decision("d-0", "kv-aware", 9, 0.0)) == ""
    # Other policies do not weigh cached blocks, and a tenant's prompt hashes differ.
    assert Dispatcher(pool.nc, pool.keys, pool.view, Chooser("least-loaded"),
                      BLOCK_SIZE).prefill_worker_for(job, decision) == ""  # fmt: skip
    salted = Job("r-2", TOKENS, SamplingParams(max_tokens=4), time.time() + 10, tenant_salt="t")
    assert dispatcher.prefill_worker_for(salted, decision) == ""
    for worker in (decode, holder, other):
        await worker.stop()


async def test_a_decode_peer_holding_most_of_the_prompt_is_named_to_prefill_it(
    pool: Pool,
) -> None:
    """A decode worker other than the chosen one, holding more of the prefix than the chosen
    worker and every prefill worker, is named when what it would compute is no more than what
    its blocks save (`holding_peer`); it then prefills for the chosen worker."""
    chosen = await start_worker(pool, "d-0")
    peer = await start_worker(pool, "d-1")
    prefill = await start_worker(pool, "p-0", role="prefill")
    chosen.changes("gpu", stored=range(0, 1))
    peer.changes("gpu", stored=range(0, 2))
    peer.changes("host", stored=range(2, 9))  # 9 of the prompt's 10 blocks, mostly in host memory
    prefill.changes("gpu", stored=range(0, 3))
    await pool.view.start()
    await pool.view.wait_for_workers(2, WAIT_S, with_state=True)
    await until(pool, lambda: all(pool.view.has_state(w) for w in ("d-0", "d-1", "p-0")))
    assert matches(pool)["d-1"] == (9, 7, 0)
    dispatcher = Dispatcher(pool.nc, pool.keys, pool.view, Chooser("kv-aware"), BLOCK_SIZE)
    job = Job("r-1", TOKENS, SamplingParams(max_tokens=4), time.time() + 10)
    assert dispatcher.prefill_worker_for(job, Decision("d-0", "kv-aware", 1, 0.0)) == "d-1"
    # Chosen itself, nobody holds more than it: no name, the queue decides.
    assert dispatcher.prefill_worker_for(job, Decision("d-1", "kv-aware", 9, 0.0)) == ""
    # A peer that would compute more than its blocks save is not named: the prefill worker is.
    peer.changes("host", removed=range(5, 9))  # 5 blocks left: saves 2 over p-0's 3, computes 5
    await until(pool, lambda: matches(pool)["d-1"][0] == 5)
    assert dispatcher.prefill_worker_for(job, Decision("d-0", "kv-aware", 1, 0.0)) == "p-0"
    for worker in (chosen, peer, prefill):
        await worker.stop()


async def test_a_kv_state_reply_of_a_lower_tier_alone_is_refused_and_retried(pool: Pool) -> None:
    """A state is the GPU's with the lower tiers beside it: a reply that claims to be one tier's
    is invalid (counted, retried), and the worker's next valid reply is loaded."""
    replies = [
        KvEvent("d-0", 1, 0, stored=(PROMPT[0],), cleared=True, tier="host"),
        KvEvent("d-0", 1, 0, stored=(PROMPT[0],), cleared=True,
                lower_tiers=(KvTierState("host", (PROMPT[1],)),)),
    ]  # fmt: skip

    async def answer(msg: Msg) -> None:
        await msg.respond(replies.pop(0).encode() if len(replies) > 1 else replies[0].encode())

    sub = await pool.nc.subscribe(pool.keys.kv_state("d-0"), cb=answer)
    record = WorkerRecord(worker_id="d-0", pod_uid="uid-d-0", incarnation=1, role="decode",
                          fingerprint=FINGERPRINT, block_size=BLOCK_SIZE,
                          is_ready=True)  # fmt: skip
    registration = await pool.registry.register(record)
    await pool.view.start()
    await pool.view.wait_for_workers(1, WAIT_S, with_state=True)
    assert pool.view.num_malformed_events == 1
    assert matches(pool) == {"d-0": (2, 1, 0)}
    await registration.close()
    await sub.unsubscribe()
