"""`python -P -m kvrail.agent`: registers one vLLM server as a worker of its pool.

The agent runs beside a `vllm serve` process (the `agent` container of a vLLM pool's pod, see
`kvrail.operator.builders.vllm`; a local process in `kvrail.testing.vllm`). It reads `Settings`:
`role`, `vllm_url`, `served_model_name` (else derived from `model`), the pod identity and etcd.

1. It waits until vLLM answers `GET /health` with 200 and `GET /v1/models` lists the served name,
   then registers a `WorkerRecord(engine="vllm")` under a lease (`kvrail.registry`): `address` is
   the base URL the router uses, `http://<pod ip>:<port of vllm_url>` when the pod IP is known,
   else `vllm_url` itself; `max_model_len` is what vLLM reports in `/v1/models`, `block_size`
   (with its KV cache's `num_blocks`) what it reports in
   `vllm:cache_config_info` (else the settings').
2. About every second it reads vLLM's Prometheus `/metrics` and publishes the load:
   `vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`
   (a fraction in [0, 1] despite its name; `vllm:gpu_cache_usage_perc` in older releases), the
   samples labelled with this served model name only.
3. When vLLM stops answering for `NOT_READY_AFTER_S`, the record stays but says `is_ready=False`
   (the router sends nothing new); when vLLM answers again it says `is_ready=True` again. The
   incarnation stays: what the router talks to is vLLM's HTTP API, whose NIXL handshakes vLLM
   redoes itself.
4. SIGTERM (or SIGINT): revoke the lease, so the record disappears at once, and exit 0. In a pod
   both containers get SIGTERM together, so the record goes while vLLM still finishes its work.

The agent needs no NATS: it publishes no KV events (vLLM's prefix cache is not indexed by the
router) and takes no requests. It logs ids, counts and URLs, never request contents.

The fingerprint (`vllm_fingerprint`) is a sha256 over what a prefill and a decode server of one
pool must share to exchange KV through vLLM's connector, as this agent can know it without
loading the model: the served name, the model source and the operator's hash of `spec.model`,
the dtypes, the block size, `max_model_len` and the tensor-parallel size. vLLM checks the real KV
layout itself at its NIXL handshake (its compatibility hash); the fingerprint keeps the router
from pairing servers of two different pool specs (a rollout) in the first place.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import aetcd
import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvrail import metrics
from kvrail.errors import ConfigError
from kvrail.keys import PoolKeys, check_label
from kvrail.messages import WorkerRecord
from kvrail.registry import Registration, Registry, etcd_client
from kvrail.settings import Settings, load_settings
from kvrail.vllm.serve import served_model_name

log = logging.getLogger(__name__)

FINGERPRINT_VERSION: Final = 1
LOAD_REFRESH_S: Final = 1.0
"""How often the load is read from vLLM and published."""
NOT_READY_AFTER_S: Final = 3.0
"""How long vLLM may fail to answer before the record says not ready (a few missed polls)."""
HTTP_TIMEOUT_S: Final = 2.0
STARTUP_TIMEOUT_S: Final = 1800.0
"""How long the agent waits for vLLM to serve at all: the engine container's startup probe
allowance (30 min to load weights, compile and capture graphs). Past it the agent exits 1."""
RUNNING: Final = metrics.VLLM_NUM_REQUESTS_RUNNING
WAITING: Final = metrics.VLLM_NUM_REQUESTS_WAITING
KV_USAGE: Final = (metrics.VLLM_KV_CACHE_USAGE_PERC, "vllm:gpu_cache_usage_perc")  # the old name
CACHE_CONFIG: Final = "vllm:cache_config_info"


class VllmUnavailable(Exception):
    """vLLM did not answer as a serving server should (down, starting, or another model)."""


@dataclass(frozen=True, slots=True)
class VllmLoad:
    """One reading of a vLLM server's load."""

    num_running: int = 0
    num_waiting: int = 0
    kv_utilization: float = 0.0
    block_size: int | None = None
    """This and `num_blocks` from `vllm:cache_config_info`, when vLLM exports it."""
    num_blocks: int = 0


def parse_metrics(text: str, served_name: str) -> VllmLoad:
    """The load in a Prometheus text exposition of vLLM's `/metrics`. Only samples labelled
    `model_name=<served_name>` count (samples without the label count too); running and waiting
    requests are summed over engines (data-parallel ranks), the KV usage is the highest.
    A metric that is missing reads 0. Raises ValueError for text that is not an exposition."""
    running = waiting = 0.0
    usage: dict[str, float] = {}
    cache: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name", served_name) != served_name:
                continue
            if sample.name == RUNNING:
                running += sample.value
            elif sample.name == WAITING:
                waiting += sample.value
            elif sample.name in KV_USAGE:
                usage[sample.name] = max(usage.get(sample.name, 0.0), sample.value)
            elif sample.name == CACHE_CONFIG:
                cache = sample.labels
    kv = next((usage[name] for name in KV_USAGE if name in usage), 0.0)
    block_size, num_blocks = (_count(cache.get(k)) for k in ("block_size", "num_gpu_blocks"))
    return VllmLoad(
        num_running=int(running),
        num_waiting=int(waiting),
        kv_utilization=min(max(kv, 0.0), 1.0),
        block_size=block_size or None,
        num_blocks=num_blocks,
    )


def _count(label: str | None) -> int:
    """A label's non-negative integer value; 0 when absent or not a number ("None")."""
    return int(label) if label is not None and label.isdigit() else 0


def served_max_model_len(models: Any, served_name: str) -> int | None:
    """`max_model_len` of `served_name` in vLLM's `GET /v1/models` answer; None when the answer
    does not list that name (vLLM still starting, or serving another model)."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return None
    for entry in models["data"]:
        if isinstance(entry, dict) and entry.get("id") == served_name:
            value = entry.get("max_model_len")
            return value if isinstance(value, int) and value > 0 else 0
    return None


def router_address(vllm_url: str, pod_ip: str | None) -> str:
    """The base URL the router reaches this vLLM server on: the pod IP with vLLM's port when the
    pod IP is known (in a pod, `vllm_url` is localhost), else `vllm_url` itself."""
    url = urlsplit(vllm_url.rstrip("/"))
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"vllm_url {vllm_url!r} is not http(s)://host:port")
    if not pod_ip:
        return vllm_url.rstrip("/")
    port = url.port or (443 if url.scheme == "https" else 80)
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"{url.scheme}://{host}:{port}"


def vllm_fingerprint(settings: Settings, served_name: str, block_size: int, max_len: int) -> str:
    """Hex sha256 of what a pool's prefill and decode servers share (see the module docstring).
    Stable across Python runs: sorted-key JSON, versioned."""
    payload = {
        "version": FINGERPRINT_VERSION,
        "engine": "vllm",
        "served_model_name": served_name,
        "model": settings.model,
        "model_revision": settings.model_revision,
        "model_hash": settings.model_hash,
        "dtype": settings.dtype,
        "kv_dtype": settings.kv_dtype,
        "block_size": block_size,
        "max_model_len": max_len,
        "tensor_parallel_size": settings.tensor_parallel_size,
    }
    if settings.quantization != "auto":  # added later: the digests of earlier pools stay
        payload["quantization"] = settings.quantization
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def build_record(
    settings: Settings,
    worker_id: str,
    incarnation: int,
    max_model_len: int,
    load: VllmLoad,
) -> WorkerRecord:
    """The record of a vLLM server that serves now (`is_ready=True`) with `load`."""
    if settings.role is None or settings.vllm_url is None:
        raise ConfigError("the vLLM agent needs KVRAIL_ROLE and KVRAIL_VLLM_URL")
    served_name = served_model_name(settings.model, settings.served_model_name)
    block_size = load.block_size or settings.block_size
    max_len = max_model_len or settings.max_model_len or 0
    return WorkerRecord(
        worker_id=worker_id,
        pod_uid=settings.pod_uid or f"local-{os.getpid()}",
        incarnation=incarnation,
        role=settings.role,
        fingerprint=vllm_fingerprint(settings, served_name, block_size, max_len),
        address=router_address(settings.vllm_url, settings.pod_ip),
        num_blocks=load.num_blocks,
        block_size=block_size,
        max_model_len=max_len,
        is_ready=True,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        kv_utilization=load.kv_utilization,
        engine="vllm",
    )


class VllmClient:
    """vLLM's `/health`, `/v1/models` and `/metrics`; every failure is a `VllmUnavailable`."""

    def __init__(self, base_url: str, served_name: str) -> None:
        self.served_name = served_name
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=HTTP_TIMEOUT_S)

    async def max_model_len(self) -> int:
        """`max_model_len` once vLLM is healthy and serves the name (0: not reported)."""
        await self._get("/health")
        try:
            models = (await self._get("/v1/models")).json()
        except ValueError as err:
            raise VllmUnavailable(f"/v1/models is not JSON: {err}") from err
        max_len = served_max_model_len(models, self.served_name)
        if max_len is None:
            raise VllmUnavailable(f"/v1/models does not list {self.served_name!r}")
        return max_len

    async def load(self) -> VllmLoad:
        await self._get("/health")
        text = (await self._get("/metrics")).text
        try:
            return parse_metrics(text, self.served_name)
        except ValueError as err:
            raise VllmUnavailable(f"/metrics is not a Prometheus exposition: {err}") from err

    async def close(self) -> None:
        await self._http.aclose()

    async def _get(self, path: str) -> httpx.Response:
        try:
            response = await self._http.get(path)
        except httpx.HTTPError as err:
            raise VllmUnavailable(f"GET {path}: {type(err).__name__} {err}") from err
        if response.status_code != 200:
            raise VllmUnavailable(f"GET {path}: HTTP {response.status_code}")
        return response


class Agent:
    def __init__(self, settings: Settings, worker_id: str) -> None:
        if settings.role is None or settings.vllm_url is None:
            raise ConfigError("the vLLM agent needs KVRAIL_ROLE and KVRAIL_VLLM_URL")
        self.settings = settings
        self.worker_id = worker_id
        self.incarnation = time.time_ns()
        self.served_name = served_model_name(settings.model, settings.served_model_name)
        self.vllm_url = settings.vllm_url
        self.stopping = asyncio.Event()

    async def run(self) -> int:
        vllm = VllmClient(self.vllm_url, self.served_name)
        try:
            max_len = await self._wait_for_vllm(vllm)
            if max_len is None:
                return 0 if self.stopping.is_set() else 1
            async with etcd_client(self.settings) as etcd:
                registry = Registry(etcd, PoolKeys(self.settings.namespace, self.settings.pool))
                load = await vllm.load()
                record = build_record(self.settings, self.worker_id, self.incarnation, max_len,
                                      load)  # fmt: skip
                registration = await registry.register(record)
                log.info(
                    "vllm worker ready worker=%s role=%s incarnation=%d address=%s model=%s "
                    "block_size=%d max_model_len=%d fingerprint=%s",
                    self.worker_id, record.role, self.incarnation, record.address,
                    self.served_name, record.block_size, record.max_model_len,
                    record.fingerprint[:12],
                )  # fmt: skip
                try:
                    await self._publish_load(vllm, registration)
                finally:
                    try:
                        await registration.close()
                    except aetcd.exceptions.ClientError as err:  # the lease expired already
                        log.warning("deregistration failed worker=%s error=%s", self.worker_id,
                                    err)  # fmt: skip
        except VllmUnavailable as err:
            log.error("vllm went away while registering worker=%s error=%s", self.worker_id, err)
            return 1
        finally:
            await vllm.close()
        log.info("vllm agent stopped worker=%s", self.worker_id)
        return 0

    async def _wait_for_vllm(self, vllm: VllmClient) -> int | None:
        """vLLM's max_model_len once it serves; None when stopped or past the deadline."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        log.info("waiting for vllm worker=%s url=%s model=%s", self.worker_id, self.vllm_url,
                 self.served_name)  # fmt: skip
        problem = ""
        while not self.stopping.is_set():
            try:
                return await vllm.max_model_len()
            except VllmUnavailable as err:
                problem = str(err)
            if time.monotonic() > deadline:
                log.error("vllm did not serve in time worker=%s timeout_s=%.0f last_error=%s",
                          self.worker_id, STARTUP_TIMEOUT_S, problem)  # fmt: skip
                return None
            await self._sleep(LOAD_REFRESH_S)
        return None

    async def _publish_load(self, vllm: VllmClient, registration: Registration) -> None:
        record = registration.record
        last_ok = time.monotonic()
        while not await self._sleep(LOAD_REFRESH_S):
            try:
                load = await vllm.load()
            except VllmUnavailable as err:
                silent_s = time.monotonic() - last_ok
                if record.is_ready and silent_s >= NOT_READY_AFTER_S:
                    log.warning("vllm not answering, worker not ready worker=%s silent_s=%.1f "
                                "error=%s", self.worker_id, silent_s, err)  # fmt: skip
                    record = dataclasses.replace(record, is_ready=False, num_running=0,
                                                 num_waiting=0)  # fmt: skip
                    await _update(registration, record)
                continue
            last_ok = time.monotonic()
            if not record.is_ready:
                log.info("vllm answering again, worker ready worker=%s", self.worker_id)
            record = dataclasses.replace(
                record, is_ready=True, num_running=load.num_running,
                num_waiting=load.num_waiting, kv_utilization=load.kv_utilization,
            )  # fmt: skip
            await _update(registration, record)

    async def _sleep(self, seconds: float) -> bool:
        """Sleep, or less when stopping; True when stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)
        return self.stopping.is_set()


async def _update(registration: Registration, record: WorkerRecord) -> None:
    """Publish a new record; a failure is logged (the lease keeper registers again)."""
    if record == registration.record:
        return
    try:
        await registration.update(record)
    except aetcd.exceptions.ClientError as err:
        log.warning("worker record update failed worker=%s error=%s", record.worker_id, err)


def main(argv: Iterable[str] | None = None) -> int:
    if argv is not None and list(argv):
        print("usage: python -P -m kvrail.agent (settings from KVRAIL_* variables)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        settings = load_settings()
        worker_id = check_label("worker id (KVRAIL_POD_NAME)", settings.pod_name or "")
        agent = Agent(settings, worker_id)
    except (ConfigError, ValueError) as err:
        print(f"kvrail vllm agent: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise

    async def run() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stopping.set)
        return await agent.run()

    return asyncio.run(run())
