"""The router's vLLM path (`VllmStream`) over real etcd and NATS, against stand-ins for vLLM.

The worker records are real (`engine="vllm"`, registered through `kvrail.registry` as the vLLM
agent registers them) and so is the router's view of them. The vLLM servers are NOT: each is a
small HTTP/1.1 server in this test that speaks vLLM 0.32's disaggregated protocol from a script,
because these tests are about the failures a real vLLM cannot be made to produce on demand (a
prefill server answering 500 or refusing connections, a decode server dying mid-stream or
hanging until a deadline, a client leaving mid-answer, a 400 that quotes the prompt). vLLM
itself is served end to end by tests/integration/test_vllm_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import nats
import pytest
from nats.aio.client import Client as NatsClient

from kvrail.codec import decode
from kvrail.keys import PoolKeys
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import GenerateRequest, WorkerRecord
from kvrail.outputs import RequestOutput, TokenEvent, TokenEventBatch, TokenLogprobs
from kvrail.registry import Registration, Registry, etcd_client
from kvrail.router.app import RouterState, create_app
from kvrail.router.discovery.view import WorkerView
from kvrail.router.metrics import RouterMetrics
from kvrail.router.policy import Chooser, Policy
from kvrail.router.streams.dispatcher import Dispatcher, DispatchError, Job
from kvrail.router.streams.vllm_options import VllmOptions
from kvrail.router.tenants import Admission, TenantTable
from kvrail.router.text.tokenizer import TextCodec
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings, default_cache_dir

FINGERPRINT = "v" * 64
MODEL = "smol"
WAIT_S = 5.0
LONG = tuple(range(100, 140))  # 40 tokens: remote prefill (threshold 32)
SHORT = (1, 2, 3)
PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "engine-p", "remote_request_id": "r", "remote_host": "127.0.0.1",
    "remote_port": 5600, "tp_size": 1,
}  # fmt: skip


# -- a scripted stand-in for one vLLM server -----------------------------------------------------


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


Behaviour = Callable[[Seen, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class FakeVllm:
    """Answers request i with `script[i]` (the last one repeats); one connection per request."""

    script: list[Behaviour]
    seen: list[Seen] = field(default_factory=list)
    requested: asyncio.Event = field(default_factory=asyncio.Event)
    left_early: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a client closed a stream this server had not finished."""
    _server: asyncio.Server | None = None

    async def start(self) -> FakeVllm:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def address(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            lines = head.split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            seen = Seen(lines[0].split()[1], headers, json.loads(body or b"{}"))
            self.seen.append(seen)
            self.requested.set()
            behaviour = self.script[min(len(self.seen) - 1, len(self.script) - 1)]
            await behaviour(seen, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the router went away: what some tests want
        finally:
            writer.close()


def reply(status: int, body: dict[str, Any]) -> Behaviour:
    async def run(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = json.dumps(body).encode()
        head = (f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\nconnection: close\r\n\r\n")  # fmt: skip
        writer.write(head.encode() + data)
        await writer.drain()

    return run


def prefilled(params: dict[str, Any] = PARAMS) -> Behaviour:
    return reply(200, {"id": "cmpl-p", "choices": [{"index": 0, "text": "x", "token_ids": None,
                                                    "finish_reason": "length"}],
                       "kv_transfer_params": params})  # fmt: skip


def top_entries(token_id: int, k: int) -> list[tuple[int, float]]:
    """A token's `top_logprobs` entries in vLLM's order (the sampled one first, then the k most
    likely): an even id is the most likely token, an odd one is not among the k."""
    top = [(1000 + j, -1.0 - j) for j in range(k)]
    return [(token_id, -0.5), *top[:-1]] if token_id % 2 == 0 and k else [(token_id, -9.0), *top]


def expected_logprobs(token_ids: tuple[int, ...], k: int) -> tuple[TokenLogprobs, ...]:
    """What the router must make of `top_entries`: the k most likely, most likely first."""
    out = []
    for t in token_ids:
        sampled, *rest = top_entries(t, k)
        if len(rest) < k:
            rest.insert(0, sampled)
        out.append(TokenLogprobs(t, sampled[1], tuple(i for i, _ in rest),
                                 tuple(v for _, v in rest)))  # fmt: skip
    return tuple(out)


def chunk(token_ids: list[int], finish: str | None = None, k: int | None = None) -> bytes:
    """One stream chunk; `k`: the request's `logprobs` (with `return_tokens_as_token_ids`)."""
    logprobs = None
    if k is not None:
        tops = [top_entries(t, k) for t in token_ids]
        logprobs = {
            "text_offset": [0] * len(token_ids),
            "tokens": [f"token_id:{t}" for t in token_ids],
            "token_logprobs": [top[0][1] for top in tops],
            "top_logprobs": [{f"token_id:{i}": v for i, v in top} for top in tops],
        }
    body = {"id": "cmpl-d", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "text": "?", "logprobs": logprobs, "finish_reason": finish,
                         "stop_reason": None, "token_ids": token_ids}]}  # fmt: skip
    data = f"data: {json.dumps(body)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def stream(*token_lists: list[int], then: str = "done") -> Behaviour:
    """A 200 event stream (chunked, as uvicorn sends it) of `token_lists`, the last finishing
    with `length`, then `[DONE]` (`then="done"`); or, after them: the connection dropped
    (`die`), or silence until the client leaves (`hang`)."""

    async def run(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")  # fmt: skip
        k = seen.body.get("logprobs") if seen.body.get("return_tokens_as_token_ids") else None
        for i, ids in enumerate(token_lists):
            last = then == "done" and i == len(token_lists) - 1
            writer.write(chunk(ids, "length" if last else None, k))
            await writer.drain()
        if then == "done":
            usage = b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\n'
            done = b"data: [DONE]\n\n"
            for data in (usage, done):
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        elif then == "hang":
            await until_client_leaves(reader, fake_of(seen))

    return run


async def until_client_leaves(reader: asyncio.StreamReader, fake: FakeVllm | None) -> None:
    await reader.read()  # b"" once the client closed its end
    if fake is not None:
        fake.left_early.set()


def hang() -> Behaviour:
    """Never answer (a server stuck before its first byte); returns when the client leaves."""

    async def run(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await until_client_leaves(reader, fake_of(seen))

    return run


_FAKES: list[FakeVllm] = []


def fake_of(seen: Seen) -> FakeVllm | None:
    return next((f for f in _FAKES if any(s is seen for s in f.seen)), None)


# -- the pool: real etcd, NATS and router view -----------------------------------------------------


@dataclass
class Pool:
    registry: Registry
    nc: NatsClient
    keys: PoolKeys
    view: WorkerView
    http: httpx.AsyncClient
    registrations: dict[str, Registration] = field(default_factory=dict)
    prefill_failures: list[str] = field(default_factory=list)

    async def server(self, worker_id: str, role: str, *script: Behaviour, **kw: Any) -> FakeVllm:
        fake = await FakeVllm(list(script)).start()
        _FAKES.append(fake)
        await self.register(worker_id, role, fake.address, **kw)
        return fake

    async def register(self, worker_id: str, role: str, address: str, **kw: Any) -> None:
        values: dict[str, Any] = dict(
            worker_id=worker_id, pod_uid=f"uid-{worker_id}", incarnation=1, role=role,
            fingerprint=FINGERPRINT, block_size=16, max_model_len=2048, is_ready=True,
            engine="vllm", address=address,
        )  # fmt: skip
        values.update(kw)
        self.registrations[worker_id] = await self.registry.register(WorkerRecord(**values))
        await self.view.wait_until(lambda: worker_id in self.view.records(), WAIT_S)

    async def unregister(self, worker_id: str) -> None:
        await self.registrations.pop(worker_id).close()
        await self.view.wait_until(lambda: worker_id not in self.view.records(), WAIT_S)

    def dispatcher(self, policy: Policy = "round-robin", **options: Any) -> Dispatcher:
        defaults = {"min_remote_prefill_tokens": 32,
                    "on_prefill_failure": self.prefill_failures.append}  # fmt: skip
        vllm = VllmOptions(self.http, MODEL, **(defaults | options))
        return Dispatcher(self.nc, self.keys, self.view, Chooser(policy), 16, vllm=vllm)


@pytest.fixture
async def pool(etcd_server: EtcdServer, nats_server: NatsServer) -> AsyncIterator[Pool]:
    keys = PoolKeys("default", f"rv-{uuid.uuid4().hex[:8]}")
    async with etcd_client(Settings(etcd_endpoints=(etcd_server.endpoint,))) as client:
        nc = await nats.connect(nats_server.url)
        registry = Registry(client, keys)
        view = WorkerView(registry, nc, keys)
        await view.start()
        await view.ready.wait()
        http = httpx.AsyncClient(trust_env=False)
        p = Pool(registry, nc, keys, view, http)
        try:
            yield p
        finally:
            for fake in _FAKES:
                await fake.stop()
            _FAKES.clear()
            for registration in p.registrations.values():
                await registration.close()
            await view.stop()
            await registry.delete_pool()
            await http.aclose()
            await nc.close()


def job(
    token_ids: tuple[int, ...] = LONG, timeout_s: float = 10.0, logprobs: int | None = None
) -> Job:
    return Job(
        f"cmpl-{uuid.uuid4().hex[:8]}",
        token_ids,
        SamplingParams(max_tokens=8, seed=5, logprobs=logprobs),
        time.time() + timeout_s,
    )


async def run(dispatcher: Dispatcher, j: Job) -> tuple[list[TokenEvent], str]:
    async with dispatcher.open(j) as s:
        events = [e async for e in s]
    assert dispatcher.in_flight == {}, "every in-flight count is released"
    return events, s.worker_id


async def collect(dispatcher: Dispatcher, j: Job, into: list[TokenEvent]) -> None:
    async with dispatcher.open(j) as s:
        async for event in s:
            into.append(event)


# -- tests ---------------------------------------------------------------------------------------


async def test_a_long_prompt_is_prefilled_remotely_and_the_params_reach_the_decode_server(
    pool: Pool,
) -> None:
    prefill = await pool.server("p-0", "prefill", prefilled())
    decode = await pool.server("d-0", "decode", stream([7, 8], [9]))
    j = job()
    events, worker = await run(pool.dispatcher("kv-aware"), j)  # no KV index: load decides
    assert worker == "d-0"
    assert [e.seq for e in events] == [0, 1] and [e.output.token_ids for e in events] == [
        (7, 8),
        (9,),
    ]
    stages = events[0].stages
    assert events[0].prefill_mode == "remote" and stages is not None
    assert stages.prefill_compute_s > 0
    assert events[-1].output.finish_reason == "length" and events[-1].is_last
    (p,), (d,) = prefill.seen, decode.seen
    assert p.path == d.path == "/v1/completions"
    assert p.headers["x-request-id"] == d.headers["x-request-id"] == j.request_id
    assert p.body["max_tokens"] == 1 and p.body["stream"] is False
    assert p.body["prompt"] == d.body["prompt"] == list(LONG) and d.body["seed"] == 5
    assert d.body["kv_transfer_params"] == PARAMS and d.body["return_token_ids"] is True


async def test_a_short_prompt_or_no_prefill_server_decodes_locally(pool: Pool) -> None:
    decode = await pool.server("d-0", "decode", stream([7], [9]))
    events, _ = await run(pool.dispatcher(), job(LONG))  # no prefill server
    stages = events[0].stages
    assert events[0].prefill_mode == "local" and stages is not None
    assert stages.prefill_compute_s == 0
    prefill = await pool.server("p-0", "prefill", prefilled())
    events, _ = await run(pool.dispatcher(), job(SHORT))  # below the threshold
    assert events[0].prefill_mode == "local"
    assert not prefill.seen and all("kv_transfer_params" not in s.body for s in decode.seen)


async def test_failed_prefills_are_retried_then_recomputed_or_failed_by_policy(pool: Pool) -> None:
    """p-0 answers 500, p-1's address refuses connections, p-2 answers without params: each is
    tried once, then `recompute` decodes locally and `fail` fails with `prefill_failed`."""
    p0 = await pool.server("p-0", "prefill", reply(500, {"error": {"message": "boom"}}))
    await pool.register("p-1", "prefill", f"http://127.0.0.1:{free_port()}")
    p2 = await pool.server("p-2", "prefill", reply(200, {"id": "x", "choices": []}))
    decode = await pool.server("d-0", "decode", stream([7], [9]))
    events, _ = await run(pool.dispatcher(), job())
    assert events[0].prefill_mode == "recompute" and [e.output.token_ids for e in events] == [
        (7,),
        (9,),
    ]
    assert "kv_transfer_params" not in decode.seen[0].body
    assert sorted(pool.prefill_failures) == ["bad_response", "connect", "status_5xx"]
    assert len(p0.seen) == len(p2.seen) == 1
    with pytest.raises(DispatchError) as err:
        await run(pool.dispatcher(kv_load_failure_policy="fail"), job())
    assert err.value.code == "prefill_failed" and len(decode.seen) == 1  # decode never asked


async def test_logprobs_come_with_every_token_the_first_included_whichever_way_it_prefilled(
    pool: Pool,
) -> None:
    """Remote, local (a short prompt) and recompute (the prefill server fails): only the decode
    server is asked for logprobs, by token id, and every event carries its tokens' own."""
    prefill = await pool.server("p-0", "prefill", prefilled(), reply(500, {}))
    decode = await pool.server("d-0", "decode", stream([6, 7], [8]))
    dispatcher = pool.dispatcher()
    for token_ids, k, mode in ((LONG, 3, "remote"), (SHORT, 0, "local"), (LONG, 20, "recompute")):
        events, _ = await run(dispatcher, job(token_ids, logprobs=k))
        assert events[0].prefill_mode == mode
        assert [e.output.logprobs for e in events] == [
            expected_logprobs((6, 7), k), expected_logprobs((8,), k)
        ]  # fmt: skip
        assert decode.seen[-1].body["logprobs"] == k
        assert decode.seen[-1].body["return_tokens_as_token_ids"] is True
    assert len(prefill.seen) == 2 and pool.prefill_failures == ["status_5xx"]
    assert all("logprobs" not in p.body for p in prefill.seen)
    events, _ = await run(dispatcher, job(SHORT))  # not asked: none read, none sent for
    assert all(e.output.logprobs == () for e in events)
    assert "logprobs" not in decode.seen[-1].body


async def test_a_failed_prefill_server_is_skipped_for_one_that_works(pool: Pool) -> None:
    await pool.server("p-0", "prefill", reply(503, {}), num_running=0)
    await pool.server("p-1", "prefill", prefilled(), num_running=5)  # busier: tried second
    decode = await pool.server("d-0", "decode", stream([7]))
    events, _ = await run(pool.dispatcher(), job())
    assert events[0].prefill_mode == "remote" and pool.prefill_failures == ["status_5xx"]
    assert decode.seen[0].body["kv_transfer_params"] == PARAMS


async def test_a_decode_server_failing_before_its_first_token_is_replaced_with_fresh_kv(
    pool: Pool,
) -> None:
    """d-0 answers 503 (it may have read the prompt's KV: the retry prefills again); d-1's
    address refuses connections (nothing was read: the same KV goes on); d-2 serves."""
    prefill = await pool.server("p-0", "prefill", prefilled())
    d0 = await pool.server("d-0", "decode", reply(503, {}))
    await pool.register("d-1", "decode", f"http://127.0.0.1:{free_port()}")
    d2 = await pool.server("d-2", "decode", stream([7], [9]))
    events, worker = await run(pool.dispatcher(), job())
    assert worker == "d-2" and [e.output.token_ids for e in events] == [(7,), (9,)]
    assert events[0].worker_id == "d-2" and events[0].prefill_mode == "remote"
    assert len(d0.seen) == len(d2.seen) == 1
    assert len(prefill.seen) == 2  # once for d-0, once more for d-1 and d-2


async def test_decode_attempts_are_bounded_and_a_death_after_the_first_token_is_worker_lost(
    pool: Pool,
) -> None:
    for i in range(4):
        await pool.server(f"d-{i}", "decode", reply(500, {}))
    with pytest.raises(DispatchError) as err:
        await run(pool.dispatcher(), job(SHORT))
    assert err.value.code == "no_worker"
    assert sum(len(f.seen) for f in _FAKES) == 3  # router_max_attempts
    for i in range(4):
        await pool.unregister(f"d-{i}")
    await pool.server("d-9", "decode", stream([7], [8], then="die"))
    got: list[TokenEvent] = []
    with pytest.raises(DispatchError) as err:
        await collect(pool.dispatcher(), job(SHORT), got)
    assert err.value.code == "worker_lost" and [e.output.token_ids for e in got] == [(7,), (8,)]


async def test_a_decode_server_whose_record_vanishes_before_its_first_token_is_replaced(
    pool: Pool,
) -> None:
    d0 = await pool.server("d-0", "decode", hang())
    await pool.server("d-1", "decode", stream([7]))
    task = asyncio.create_task(run(pool.dispatcher(), job(SHORT)))
    await asyncio.wait_for(d0.requested.wait(), WAIT_S)
    await pool.unregister("d-0")
    events, worker = await asyncio.wait_for(task, WAIT_S)
    assert worker == "d-1" and events[0].output.token_ids == (7,)
    await asyncio.wait_for(d0.left_early.wait(), WAIT_S)  # and d-0's request was closed


async def test_leaving_the_stream_early_closes_the_upstream_connection(pool: Pool) -> None:
    decode = await pool.server("d-0", "decode", stream([7], then="hang"))
    dispatcher = pool.dispatcher()
    async with dispatcher.open(job(SHORT)) as s:
        async for event in s:
            assert event.output.token_ids == (7,)
            break  # a client that disconnects, or a stop string
    await asyncio.wait_for(decode.left_early.wait(), WAIT_S)
    assert dispatcher.in_flight == {}


async def test_the_deadline_bounds_the_prefill_and_the_decode(pool: Pool) -> None:
    prefill = await pool.server("p-0", "prefill", hang())
    decode = await pool.server("d-0", "decode", stream([7], then="hang"))
    dispatcher = pool.dispatcher()
    for token_ids in (LONG, SHORT):  # stuck in the prefill, then in the decode stream
        started = time.monotonic()
        with pytest.raises(DispatchError) as err:
            await run(dispatcher, job(token_ids, timeout_s=1.0))
        assert err.value.code == "deadline" and time.monotonic() - started < 3
    assert pool.prefill_failures == []  # a deadline is not the prefill server's failure
    await asyncio.wait_for(prefill.left_early.wait(), WAIT_S)
    await asyncio.wait_for(decode.left_early.wait(), WAIT_S)


async def test_a_slow_prefill_times_out_and_follows_the_policy(pool: Pool) -> None:
    await pool.server("p-0", "prefill", hang())
    await pool.server("d-0", "decode", stream([7]))
    events, _ = await run(pool.dispatcher(prefill_timeout_s=0.3), job())
    assert events[0].prefill_mode == "recompute" and pool.prefill_failures == ["timeout"]


async def test_refused_input_is_invalid_request_and_vllms_message_is_not_repeated(
    pool: Pool,
) -> None:
    secret = {"error": {"message": "prompt 'my secret text' is too long", "code": 400}}
    await pool.server("p-0", "prefill", reply(400, secret))
    await pool.server("d-0", "decode", reply(400, secret))
    for token_ids in (LONG, SHORT):  # refused by the prefill server, then by the decode server
        with pytest.raises(DispatchError) as err:
            await run(pool.dispatcher(), job(token_ids))
        assert err.value.code == "invalid_request" and "secret" not in str(err.value)


async def test_engines_never_mix_and_a_router_without_vllm_options_ignores_vllm_servers(
    pool: Pool,
) -> None:
    """A kvrail decode worker (its NATS subject answered here) and a vLLM decode server in one
    pool, as during a change of engine: each request goes to one of them in its own protocol."""
    nats_requests: dict[str, int] = {"k-0": 0, "v-0": 0}

    def counter(worker_id: str) -> Callable[[Any], Awaitable[None]]:
        async def count(msg: Any) -> None:
            nats_requests[worker_id] += 1
            request = decode(msg.data, GenerateRequest)
            done = TokenEvent(RequestOutput(request.request_id, (4,), "stop"), 0, worker_id)
            await pool.nc.publish(request.stream_subject, TokenEventBatch((done,)).encode())

        return count

    for worker_id in nats_requests:
        await pool.nc.subscribe(pool.keys.decode_requests(worker_id), cb=counter(worker_id))
    await pool.register("k-0", "decode", "", engine="kvrail")
    vllm = await pool.server("v-0", "decode", stream([7]))
    both = pool.dispatcher()  # round-robin: alternates between the two
    served = [(await run(both, job(SHORT)))[1] for _ in range(4)]
    assert sorted(served) == ["k-0", "k-0", "v-0", "v-0"]
    assert nats_requests == {"k-0": 2, "v-0": 0} and len(vllm.seen) == 2
    kvrail_only = Dispatcher(pool.nc, pool.keys, pool.view, Chooser("round-robin"), 16)
    assert {(await run(kvrail_only, job(SHORT)))[1] for _ in range(3)} == {"k-0"}
    assert len(vllm.seen) == 2


# -- the HTTP API over a vLLM pool -----------------------------------------------------------------


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.load("smollm2", default_cache_dir())


async def test_the_api_detokenizes_vllms_ids_and_answers_its_failures_as_openai_errors(
    pool: Pool, codec: TextCodec
) -> None:
    """The router's own text path over a vLLM decode stream (text, usage, logprobs), then the
    codes of a vLLM pool's failures as HTTP statuses: `prefill_failed` 503, `invalid_request`
    400 (without vLLM's message)."""
    answer = codec.encode(" Paris is the capital.")
    decode = await pool.server(
        "d-0", "decode", stream(answer[:2], answer[2:]), stream(answer[:2], answer[2:]),
        reply(400, {"error": {"message": "my secret prompt is too long"}}),
    )  # fmt: skip
    await pool.server("p-0", "prefill", reply(500, {}))
    metrics = RouterMetrics()
    dispatcher = pool.dispatcher(
        kv_load_failure_policy="fail", on_prefill_failure=metrics.prefill_failure
    )
    state = RouterState(
        codec=codec, dispatcher=dispatcher, view=pool.view, tenants=TenantTable.load(None),
        admission=Admission(), metrics=metrics, served_name=MODEL, max_model_len=0,
        request_timeout_s=10,
    )  # fmt: skip
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:

        async def complete(prompt: list[int]) -> httpx.Response:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            return await client.post("/v1/completions", json=body)

        ok = await complete(list(SHORT))
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == codec.decode(answer)
        assert ok.json()["usage"]["completion_tokens"] == len(answer)
        body = {"model": MODEL, "prompt": list(SHORT), "max_tokens": 16, "logprobs": 2}
        asked = await client.post("/v1/completions", json=body)
        assert asked.status_code == 200, asked.text
        got = asked.json()["choices"][0]["logprobs"]
        expected = expected_logprobs(tuple(answer), 2)
        assert got["tokens"] == [codec.token_text(t) for t in answer]
        assert got["token_logprobs"] == [e.logprob for e in expected]
        assert got["top_logprobs"] == [
            {codec.token_text(t): v for t, v in zip(e.top_token_ids, e.top_logprobs, strict=True)}
            | ({} if e.token_id in e.top_token_ids else {codec.token_text(e.token_id): e.logprob})
            for e in expected
        ]
        failed = await complete(list(LONG))  # remote prefill: 500, and the policy is fail
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "prefill_failed"
        refused = await complete(list(SHORT))
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_request"
        assert "secret" not in refused.text
        scraped = (await client.get("/metrics")).text
    assert 'kvrail_kv_transfer_failures_total{reason="status_5xx"} 1.0' in scraped
    assert 'kvrail_time_to_first_token_seconds_count{prefill_mode="local"} 2.0' in scraped
    assert len(decode.seen) == 3
