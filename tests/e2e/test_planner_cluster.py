"""The planner on the full harness: the operator (a subprocess under the chart's RBAC, with its own
token) reads a real JetStream backlog and real worker records in etcd, and scales the real
StatefulSets on the real API server, each role on its own signal, within min/max, with the
stabilization windows. Reaction times are measured and printed (docs/operator.md).

Not covered here: "a prefill worker removed during load loses no job" needs real prefill workers
(the worker issue), which do not exist yet.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvrail.bus import PrefillQueue, connect
from kvrail.crd.pool import GROUP, PLURAL, VERSION
from kvrail.keys import PoolKeys
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import PrefillJob, WorkerRecord
from kvrail.operator.testing import mutate, pool_manifest
from kvrail.registry import Registration, Registry, etcd_client
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings
from kvrail.testing.kube import ADMIN, KubeControlPlane
from kvrail.testing.operator_process import (
    REPO,
    launch_operator,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.helm]

NAMESPACE = "kvrail-planner"
POOL = "planned"
DEADLINE_S = 60
UP_WINDOW_S, DOWN_WINDOW_S, INTERVAL_S = 2, 6, 1
AUTOSCALED = (
    ("spec.autoscaling.enabled", True),
    ("spec.autoscaling.intervalSeconds", INTERVAL_S),
    ("spec.autoscaling.scaleUpStabilizationSeconds", UP_WINDOW_S),
    ("spec.autoscaling.scaleDownStabilizationSeconds", DOWN_WINDOW_S),
    ("spec.autoscaling.cooldownSeconds", 0),
    ("spec.autoscaling.prefillQueueTarget", 4),
    ("spec.autoscaling.decodeKvUtilizationTarget", 50),
    ("spec.prefill.minReplicas", 1),
    ("spec.prefill.maxReplicas", 4),
    ("spec.decode.minReplicas", 1),
    ("spec.decode.maxReplicas", 3),
    ("spec.topology.rdma", "none"),
)
T = TypeVar("T")


class Loop:
    """An event loop on a thread: registrations keep their leases alive while the test polls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Env:
    admin: client.ApiClient
    servers: Settings
    loop: Loop
    seen: dict[str, list[int]] = field(default_factory=lambda: {"prefill": [], "decode": []})

    def replicas(self) -> dict[str, int]:
        """Both StatefulSets' spec.replicas; every reading is kept in `seen`."""
        apps = client.AppsV1Api(self.admin)
        out = {}
        for role in ("prefill", "decode"):
            try:
                sts = apps.read_namespaced_stateful_set(f"{POOL}-{role}", NAMESPACE)
            except ApiException as err:
                if err.status == 404:
                    return {}
                raise
            out[role] = sts.spec.replicas
            self.seen[role].append(sts.spec.replicas)
        return out

    def until(self, what: str, role: str, replicas: int) -> float:
        """Seconds until `role` has `replicas` (polled every 50 ms, within the deadline)."""
        start = time.monotonic()
        wait_for(what, lambda: self.replicas().get(role) == replicas, DEADLINE_S, 0.05)
        return time.monotonic() - start

    def autoscaling_status(self) -> dict[str, Any]:
        pool = client.CustomObjectsApi(self.admin).get_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, POOL
        )
        return pool.get("status", {}).get("autoscaling", {})  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def env(
    kube_cluster: KubeControlPlane,
    helm_binary: Path,
    etcd_server: EtcdServer,
    nats_server: NatsServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Env]:
    admin = config.new_client_from_config(str(kube_cluster.kubeconfig(ADMIN)))
    kubectl = [str(Path(sys.executable).parent / "kubectl"),
               f"--kubeconfig={kube_cluster.kubeconfig(ADMIN)}"]  # fmt: skip
    _run([*kubectl, "apply", "--server-side", "-f", str(REPO / "crds")])
    _run([*kubectl, "wait", "--for=condition=Established", "--timeout=60s",
          "crd/inferencepools.kvrail.dev"])  # fmt: skip
    settings = {"etcd_endpoints": etcd_server.endpoint, "nats_url": nats_server.url}
    operator, _, _ = launch_operator(
        kube_cluster.kubeconfig(ADMIN), helm_binary, [NAMESPACE],
        tmp_path_factory.mktemp("planner"), settings,
    )  # fmt: skip
    loop = Loop()
    servers = Settings(etcd_endpoints=(etcd_server.endpoint,), nats_url=nats_server.url)
    try:
        yield Env(admin, servers, loop)
        assert operator.is_running(), f"the operator exited\n{operator.tail()}"
    finally:
        operator.stop()
        loop.stop()
        admin.close()
    log = operator.log_path.read_text()
    assert "Forbidden" not in log and " 403" not in log, "the operator lacked a permission"


def _run(argv: list[str], stdin: str | None = None) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr


def job(i: int, num_tokens: int = 100) -> PrefillJob:
    return PrefillJob(request_id=f"req-{i}", token_ids=tuple(range(num_tokens)),
                      fingerprint="f" * 64, dest_worker_id="decode-0", dest_incarnation=1,
                      dest_agent_name="agent", dest_block_ids=(1,), first_block_index=0,
                      deadline_unix_s=time.time() + 600,
                      sampling=SamplingParams(max_tokens=1))  # fmt: skip


def record(worker_id: str, kv_utilization: float) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, pod_uid=f"uid-{worker_id}", incarnation=1,
                        role="decode", fingerprint="f" * 64, is_ready=True,
                        num_running=4, kv_utilization=kv_utilization)  # fmt: skip


async def publish(servers: Settings, keys: PoolKeys, num_jobs: int) -> None:
    nc = await connect(servers, "e2e-decode-worker")
    try:
        queue = PrefillQueue(nc.jetstream(), keys)
        await queue.ensure_stream()
        for i in range(num_jobs):
            assert await queue.publish(job(i))
    finally:
        await nc.close()


async def drain(servers: Settings, keys: PoolKeys, num_jobs: int) -> None:
    """What prefill workers do: pull every job and ack it."""
    nc = await connect(servers, "e2e-prefill-worker")
    try:
        consumer = await PrefillQueue(nc.jetstream(), keys).consumer("prefill-0")
        for _ in range(num_jobs):
            queued = await consumer.fetch(timeout_s=5)
            assert queued is not None and queued.job is not None
            await queued.ack()
        await consumer.close()
    finally:
        await nc.close()


async def register(servers: Settings, keys: PoolKeys, kv: float, n: int) -> list[Registration]:
    registry = Registry(etcd_client(servers), keys)
    await registry.client.connect()
    return [await registry.register(record(f"decode-{i}", kv), ttl_s=5) for i in range(n)]


def test_backlog_scales_prefill_up_and_down_and_kv_load_scales_decode_alone(env: Env) -> None:
    keys = PoolKeys(NAMESPACE, POOL)
    manifest = mutate(pool_manifest(POOL, NAMESPACE), *AUTOSCALED)
    client.CustomObjectsApi(env.admin).create_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, manifest
    )
    wait_for("both StatefulSets", lambda: len(env.replicas()) == 2, DEADLINE_S)
    env.loop.run(publish(env.servers, keys, 0))  # the stream exists, empty

    # A burst: 20 jobs want 5 prefill replicas; max is 4. Decode has no reports: it holds.
    env.loop.run(publish(env.servers, keys, 20))
    up_s = env.until("prefill scaled up to max", "prefill", 4)
    status = wait_for("the decision in status",
                      lambda: env.autoscaling_status().get("prefill", {}).get("reason") in
                      ("AtMaxReplicas", "Steady"), DEADLINE_S)  # fmt: skip
    assert status
    recorded = env.autoscaling_status()
    assert recorded["prefill"]["backlogJobs"] == 20
    assert recorded["prefill"]["backlogTokens"] == 2000
    assert recorded["decode"]["reason"] == "SignalsMissing"
    assert env.replicas() == {"prefill": 4, "decode": 1}

    # Drain: the jobs are pulled and acked; prefill returns to min after the down window.
    drained_at = time.monotonic()
    env.loop.run(drain(env.servers, keys, 20))
    drain_s = time.monotonic() - drained_at
    down_s = env.until("prefill scaled down to min", "prefill", 1)
    # The last tick that saw the backlog was at most one interval before the drain ended.
    assert down_s >= DOWN_WINDOW_S - INTERVAL_S - drain_s, "scaled down before the down window"

    # Decode load: two workers at 90 % KV against a 50 % target want 4 replicas; max is 3.
    registrations = env.loop.run(register(env.servers, keys, 0.9, 2))
    try:
        decode_s = env.until("decode scaled up to max", "decode", 3)
        decision = wait_for("the decode decision", lambda: env.autoscaling_status()
                            .get("decode", {}).get("reportingWorkers"), DEADLINE_S)  # fmt: skip
        assert decision == 2
        assert env.replicas()["prefill"] == 1
    finally:
        for registration in registrations:
            env.loop.run(registration.close())

    assert max(env.seen["prefill"]) == 4 and min(env.seen["prefill"]) == 1
    assert max(env.seen["decode"]) == 3 and min(env.seen["decode"]) == 1
    prefill_after_load = env.seen["prefill"][env.seen["prefill"].index(4) :]
    assert sorted(set(prefill_after_load)) == [1, 4], "prefill went through no other size"
    events = client.CoreV1Api(env.admin).list_namespaced_event(
        NAMESPACE, field_selector=f"involvedObject.name={POOL}"
    )
    reasons = {e.reason for e in events.items}
    assert {"PlannerScaleUp", "PlannerScaleDown"} <= reasons, reasons
    print(f"\nplanner reaction (interval {INTERVAL_S}s, up window {UP_WINDOW_S}s, "
          f"down window {DOWN_WINDOW_S}s):\n"
          f"  20 jobs published -> prefill 1 -> 4 (max): {up_s:.2f}s\n"
          f"  queue drained -> prefill 4 -> 1 (min): {down_s:.2f}s\n"
          f"  2 decode workers at 90% KV -> decode 1 -> 3 (max): {decode_s:.2f}s")  # fmt: skip

    client.CustomObjectsApi(env.admin).delete_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, POOL
    )
    wait_for("the pool deleted", lambda: not env.replicas(), DEADLINE_S)
