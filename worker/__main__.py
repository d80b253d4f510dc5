"""`python -P -m kvrail.worker --role prefill|decode|colocated [--worker-id ID]`

Loads settings from the environment, builds the engine (CUDA when available, else CPU), registers
the NIXL agent over the engine's one KV tensor, registers the worker in etcd under a lease
(refreshed, with its load, about every second), answers debug queries with its block counts,
publishes KV events and answers KV state queries (see `kv_events.py`) and runs its role. SIGTERM
(or SIGINT): stop taking work, finish what is in flight, deregister and exit 0. Logs hold ids and
sizes only, never token ids, text or KV bytes.

With `KVRAIL_TENSOR_PARALLEL_SIZE` N > 1 this process is rank 0 of N (`kvrail.worker.ranks`):
it refuses at once, with exit code 2 and the reason, a model that does not split over N ranks
(or N GPUs it does not have); it starts ranks 1..N-1, and its record lists every rank's KV
region. When a rank dies the worker fails as a whole, never hangs: its lease is revoked at once
(no router or peer sends it more work), the requests in flight end with an error event, the
other ranks are stopped, and it exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time

import aetcd
import torch
import uvloop
from nats.aio.msg import Msg

from kvrail.bus import PrefillQueue, connect, unsubscribe
from kvrail.endpoints import parse_endpoint
from kvrail.errors import ConfigError
from kvrail.keys import PoolKeys, check_label
from kvrail.messages import DECODE_ROLES, BlockCounts, WorkerRecord, WorkerRole
from kvrail.model_files import resolve
from kvrail.registry import Registration, Registry, etcd_client
from kvrail.settings import Settings, load_settings
from kvrail.tasks import cancel_and_wait
from kvrail.worker import health, metrics
from kvrail.worker.engine.config import DTYPES, EngineConfig, kv_cache_dtype
from kvrail.worker.ranks.build import BuiltEngine, check_split
from kvrail.worker.ranks.build import build_engine as build_sharded_engine
from kvrail.worker.roles.context import WorkerContext
from kvrail.worker.roles.decode import DecodeRole
from kvrail.worker.roles.kv_events import KvEventPublisher
from kvrail.worker.roles.peers import PeerTable
from kvrail.worker.roles.prefill import PrefillRole
from kvrail.worker.service import EngineService
from kvrail.worker.tier_usage import kv_tier_usage
from kvrail.worker.transfer.connector import Connector
from kvrail.worker.transfer.kv_connector import KvConnector
from kvrail.worker.transfer.rdma import rdma_devices, rdma_problem
from kvrail.worker.transfer.sharded import ShardedConnector

log = logging.getLogger("kvrail.worker")

_LOAD_REFRESH_S = 1.0
_FAILED_TEARDOWN_S = 10.0  # a failed worker's bounded teardown before it exits anyway
EXIT_FAILED = 1


def _device_and_dtype(settings: Settings) -> tuple[str, torch.dtype]:
    """The device type this worker computes on and its model dtype (auto: bfloat16 on a GPU,
    float32 on CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if settings.dtype == "auto":
        return device, torch.bfloat16 if device == "cuda" else torch.float32
    return device, DTYPES[settings.dtype]


def build_engine(settings: Settings, agent_name: str | None = None) -> BuiltEngine:
    device, dtype = _device_and_dtype(settings)
    kv_cache_dtype(settings.kv_dtype, dtype, device)  # refused here, before the model loads
    config = EngineConfig(
        num_blocks=settings.num_kv_blocks, block_size=settings.block_size,
        max_model_len=settings.max_model_len or 0, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_mixed_prefill_tokens=settings.max_num_mixed_prefill_tokens,
        max_mixed_graph_tokens=settings.max_mixed_graph_tokens,
        zero_kv_on_release=settings.zero_kv_on_release, kv_dtype=settings.kv_dtype,
        kv_host_tier_bytes=settings.kv_host_tier_bytes,
        kv_disk_tier_path=settings.kv_disk_tier_path,
        kv_disk_tier_bytes=settings.kv_disk_tier_bytes,
    )  # fmt: skip
    return build_sharded_engine(
        settings.model, config, dtype=dtype, device_type=device,
        tensor_parallel_size=settings.tensor_parallel_size, agent_name=agent_name,
        torch_num_threads=settings.torch_num_threads, log_level=settings.log_level,
        quantization=settings.quantization,
    )  # fmt: skip


def make_connector(agent_name: str, built: BuiltEngine) -> Connector:
    """Rank 0's NIXL agent over its KV region, with every other rank's when there are some."""
    local = KvConnector(agent_name, built.engine.kv_cache)
    if built.ranks is None:
        return local
    readies = built.ranks.readies
    return ShardedConnector(local, built.ranks.transfer_clients(), [r.metadata for r in readies])


class Worker:
    def __init__(
        self, settings: Settings, role: WorkerRole, worker_id: str, http_front: str = ""
    ) -> None:
        self.settings = settings
        self.role: WorkerRole = role
        self.worker_id = worker_id
        self.http_front = http_front
        self.incarnation = time.time_ns()
        self.agent_name = f"{worker_id}-{self.incarnation}"
        self.keys = PoolKeys(settings.namespace, settings.pool)
        self.stopping = asyncio.Event()
        self.failed: str | None = None
        """Why the worker failed as a whole (a tensor-parallel rank died), or None."""

    def fail(self, reason: str) -> None:
        """Fail the whole worker (on the event loop): stop at once, without draining. A
        watchdog ends the process should the teardown itself hang (an engine thread stuck in a
        collective that no abort reaches): the lease then expires on its own."""
        if self.failed is None:
            self.failed = reason
            log.error("worker failed worker=%s reason=%s", self.worker_id, reason)
            watchdog = threading.Timer(3 * _FAILED_TEARDOWN_S, _hard_exit, (self.worker_id,))
            watchdog.daemon = True
            watchdog.start()
        self.stopping.set()

    async def run(self) -> None:
        settings = self.settings
        built = await asyncio.to_thread(build_engine, settings, self.agent_name)
        # The model, the KV pool's block objects and the modules stay for the process's life: out
        # of the collector's sight, a full collection no longer walks them. Unfrozen, one took
        # 0.57 s with SmolLM2 and 8,000 blocks on the development VM, a stall of every stream.
        gc.collect()
        gc.freeze()
        try:
            await self._run(built)
        finally:
            if built.ranks is not None:
                await asyncio.to_thread(built.ranks.close)
                built.engine.model.group.close()

    async def _run(self, built: BuiltEngine) -> None:
        settings = self.settings
        engine = built.engine
        if built.ranks is not None:
            loop = asyncio.get_running_loop()

            def on_lost(rank: int, code: int | None) -> None:  # on the rank's watcher thread
                with contextlib.suppress(RuntimeError):  # the loop is closed: the worker ended
                    loop.call_soon_threadsafe(self.fail, f"rank_{rank}_lost_exit_{code}")

            built.ranks.on_lost(on_lost)
        fingerprint = engine.fingerprint.digest
        served_name = settings.served_model_name or resolve(settings.model).served_name
        region = engine.kv_cache
        connector = make_connector(self.agent_name, built)
        nc = await connect(settings, f"kvrail-{self.role}-{self.worker_id}")
        kv_events = KvEventPublisher(nc, self.keys, self.worker_id, self.incarnation)
        service = EngineService(
            engine, asyncio.get_running_loop(), on_kv_changes=kv_events.on_changes
        ).start()
        etcd = etcd_client(settings)
        registry = Registry(etcd, self.keys)
        prefill_queue = PrefillQueue(nc.jetstream(), self.keys)
        await prefill_queue.ensure_stream()
        counts = await service.counts()
        record = WorkerRecord(
            worker_id=self.worker_id, pod_uid=settings.pod_uid or f"local-{os.getpid()}",
            incarnation=self.incarnation, role=self.role, fingerprint=fingerprint,
            address=settings.pod_ip or "", nixl_agent_name=self.agent_name,
            nixl_metadata_b64=base64.b64encode(connector.metadata()).decode(),
            tensor_parallel_size=engine.model.group.size,
            rank_nixl_metadata_b64=tuple(
                base64.b64encode(m).decode() for m in connector.rank_metadata()
            ),
            num_blocks=counts.num_blocks, block_bytes=region.block_bytes,
            block_size=engine.config.block_size, max_model_len=engine.max_request_tokens,
            transport=connector.transport, is_ready=False, http_front=self.http_front,
        )  # fmt: skip
        registration = await registry.register(record)
        peers = PeerTable(registry, self.worker_id)
        peers_task = asyncio.create_task(peers.run(), name="peers")
        ctx = WorkerContext(
            settings=settings, keys=self.keys, worker_id=self.worker_id,
            incarnation=self.incarnation, agent_name=self.agent_name, fingerprint=fingerprint,
            block_size=engine.config.block_size,
            nc=nc, prefill_queue=prefill_queue, service=service, connector=connector, peers=peers,
        )  # fmt: skip
        roles: list[DecodeRole | PrefillRole] = []
        if self.role in DECODE_ROLES:
            roles.append(DecodeRole(ctx))
        # Decode workers prefill what a peer names them for (they hold its prefix), nothing else.
        roles.append(PrefillRole(ctx, shared_queue=self.role == "prefill"))

        async def answer_debug(msg: Msg) -> None:
            c = await service.counts()
            reply = BlockCounts(
                worker_id=self.worker_id, incarnation=self.incarnation, num_blocks=c.num_blocks,
                num_free_blocks=c.num_free_blocks, num_requests=c.num_requests,
                num_retained=c.num_retained, num_pending=sum(r.num_pending for r in roles),
            )  # fmt: skip
            await msg.respond(reply.encode())

        debug_sub = await nc.subscribe(self.keys.debug(self.worker_id), cb=answer_debug)
        deregistered = False
        await kv_events.start()
        try:
            await asyncio.wait_for(peers.ready.wait(), timeout=30.0)
            problem = rdma_problem(settings.rdma, os.environ, rdma_devices())
            if problem is not None:
                # Registered, never ready: no router or peer sends it work; the reason is in the
                # log until the worker is stopped.
                log.error("worker not ready worker=%s reason=%s", self.worker_id, problem)
                await self.stopping.wait()
                return
            for role in roles:
                await role.start()
            record = _with(record, is_ready=True)
            await _update(registration, record)
            # Until the first refresh the gauges say what the record says: no load (an EPP
            # scraping a pod that just turned ready finds every series).
            metrics.report_load(served_name, 0, 0, 0.0)
            health.set_ready(True)
            log.info(
                "worker ready worker=%s role=%s incarnation=%d agent=%s fingerprint=%s "
                "blocks=%d block_bytes=%d device=%s transport=%s",
                self.worker_id, self.role, self.incarnation, self.agent_name, fingerprint[:12],
                counts.num_blocks, region.block_bytes, engine.device, connector.transport,
            )  # fmt: skip
            while not self.stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), _LOAD_REFRESH_S)
                if self.stopping.is_set():
                    break
                c = await service.counts()
                utilization = metrics.kv_cache_usage(c.num_free_blocks, c.num_blocks)
                metrics.report_load(served_name, c.num_running, c.num_waiting, utilization)
                usage = {t: (c.tiers.used_bytes[t], c.tiers.capacity_bytes[t], n)
                         for t, n in c.tiers.blocks.items()}  # fmt: skip
                record = _with(
                    record, num_running=c.num_running, num_waiting=c.num_waiting,
                    kv_utilization=utilization,
                    kv_tiers=kv_tier_usage(usage, c.tiers.hit_blocks, c.tiers.loads),
                )  # fmt: skip
                await _update(registration, record)
            health.set_ready(False)
            if self.failed is not None:
                deregistered = True
                await _fail_fast(registration, roles)
            else:
                log.info("worker draining worker=%s", self.worker_id)
                await _update(registration, _with(record, is_ready=False))
                for role in roles:
                    await role.drain(settings.drain_timeout_s)
        finally:
            await unsubscribe(debug_sub)
            await cancel_and_wait(peers_task)
            try:
                if not deregistered:  # a failed worker deregistered first thing
                    await registration.close()
            except aetcd.exceptions.ClientError as err:  # the lease expired already
                log.warning("deregistration failed worker=%s error=%s", self.worker_id, err)
            if self.failed is None:
                await service.close()
            else:  # bounded: the engine thread may be stuck in a collective, or fail on its ranks
                try:
                    await asyncio.wait_for(service.close(1.0), _FAILED_TEARDOWN_S)
                except Exception as err:  # the worker exits 1 either way
                    log.warning("engine close failed worker=%s error=%r", self.worker_id, err)
            await kv_events.close()
            await nc.drain()
            await etcd.close()
            connector.close()
        log.info("worker stopped worker=%s", self.worker_id)


def _hard_exit(worker_id: str) -> None:
    log.error("worker teardown hung; exiting now worker=%s", worker_id)
    logging.shutdown()
    os._exit(EXIT_FAILED)


async def _fail_fast(registration: Registration, roles: list[DecodeRole | PrefillRole]) -> None:
    """A failed worker: revoke the lease at once, then end every request in flight (bounded)."""
    try:
        await registration.close()
    except aetcd.exceptions.ClientError as err:
        log.warning("deregistration failed worker=%s error=%s", registration.record.worker_id, err)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(
            asyncio.gather(*(role.drain(0.0) for role in roles), return_exceptions=True),
            _FAILED_TEARDOWN_S,
        )


async def _update(registration: Registration, record: WorkerRecord) -> None:
    """Publish a new record; a failure is logged (the lease keeper registers again)."""
    try:
        await registration.update(record)
    except aetcd.exceptions.ClientError as err:
        log.warning("worker record update failed worker=%s error=%s", record.worker_id, err)


def _with(record: WorkerRecord, **changes: object) -> WorkerRecord:
    from dataclasses import replace

    return replace(record, **changes)  # type: ignore[arg-type]


def _front_address(address: str) -> str:
    """`ip:port` normalised as the record holds it (`kvrail.endpoints`: IPv6 as `[addr]:port`,
    also from the kubelet's unbracketed `$(KVRAIL_POD_IP):port`); ValueError names the option."""
    try:
        return parse_endpoint(address)
    except ValueError as err:
        raise ValueError(f"--http-front: {err}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P -m kvrail.worker")
    parser.add_argument(
        "--role",
        choices=("prefill", "decode", "colocated", "both"),
        required=True,
        help="colocated: prefill and decode in this worker (`both` is its old spelling)",
    )
    parser.add_argument("--worker-id", help="a DNS-1123 label; default: the pod name")
    parser.add_argument(
        "--http-front", default="", metavar="IP:PORT",
        help="advertise this worker's HTTP front (a router started with --pin-worker for it) "
        "in its record, for Gateway API endpoint pickers (docs/epp.md)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        worker_id = check_label("worker id", args.worker_id or settings.pod_name or "")
        http_front = _front_address(args.http_front) if args.http_front else ""
        if settings.tensor_parallel_size > 1:  # refuse a model that cannot split before anything
            device, dtype = _device_and_dtype(settings)
            check_split(
                settings.model, settings.tensor_parallel_size, device, dtype, settings.quantization
            )
    except (ConfigError, ValueError) as err:
        print(f"kvrail worker: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if settings.http_port is not None:
        health.serve(settings.http_port)
    if settings.torch_num_threads is not None:
        torch.set_num_threads(settings.torch_num_threads)
    role: WorkerRole = "colocated" if args.role == "both" else args.role
    worker = Worker(settings, role, worker_id, http_front)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stopping.set)
        await worker.run()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())
    return EXIT_FAILED if worker.failed is not None else 0


if __name__ == "__main__":
    sys.exit(main())
