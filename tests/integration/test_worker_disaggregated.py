"""Disaggregated serving end to end: every role its own process, real etcd, NATS and NIXL.

Four workers of one pool start once for the module (SmolLM2 on CPU, one torch thread each):
`prefill-0`, `decode-0` and `decode-1` (disaggregated, a low remote-prefill threshold,
checksums on, kvLoadFailurePolicy recompute) and `colo-0` (role `colocated`: the
baseline). Tests talk to them as the router would: a `GenerateRequest` on a decode worker's
subject, `TokenEvent`s back on a stream subject, each worker's debug subject for its block
counts, and its KV events and KV state; every test ends with every live worker's blocks free.
The fault tests kill workers, so they run last, in file order: `decode-1` is killed and
restarted (a new incarnation, with the `fail` policy), then `prefill-0` is killed for good.
"""

from __future__ import annotations

import asyncio
import functools
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient
from prometheus_client.parser import text_string_to_metric_families

from kvrail.bus import PrefillQueue, connect
from kvrail.codec import decode
from kvrail.hashing import block_hashes, root_hash
from kvrail.keys import PoolKeys
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import Cancel, KvEvent, PrefillJob, WorkerRecord
from kvrail.outputs import TokenEvent
from kvrail.sampling import SamplingParams
from kvrail.testing.pool import LocalPool, tokens_of
from kvrail.testing.pool import generate as pool_generate
from kvrail.testing.pool import random_prompt as prompt

POOL = f"wd-{uuid.uuid4().hex[:8]}"
KEYS = PoolKeys("default", POOL)
LONG_PROMPT = 150  # tokens: remote prefill (threshold 32)
SHORT_PROMPT = 12  # tokens: local prefill
SERVED_NAME = "wd-served-model"  # decode-0's, the label of its vLLM-named gauges


class Pool(LocalPool):
    """The module's workers; `metrics_ports` are where two of them serve Prometheus."""

    def __init__(self, etcd: EtcdServer, nats: NatsServer, log_dir: Path) -> None:
        super().__init__(etcd, nats, log_dir, POOL, {
            "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": "32",
            "KVRAIL_TRANSFER_CHECKSUMS": "true",
            "KVRAIL_KV_LOAD_FAILURE_POLICY": "recompute",
            "KVRAIL_NUM_KV_BLOCKS": "96",
            "KVRAIL_MAX_MODEL_LEN": "1024",
        })  # fmt: skip
        self.metrics_ports = {"prefill-0": free_port(), "decode-0": free_port()}


@pytest.fixture(scope="module")
def pool(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pool]:
    p = Pool(etcd_server, nats_server, tmp_path_factory.mktemp("workers"))
    try:
        p.start("prefill-0", "prefill", KVRAIL_HTTP_PORT=str(p.metrics_ports["prefill-0"]))
        p.start(
            "decode-0", "decode", KVRAIL_HTTP_PORT=str(p.metrics_ports["decode-0"]),
            KVRAIL_SERVED_MODEL_NAME=SERVED_NAME,
        )  # fmt: skip
        p.start("decode-1", "decode")
        p.start("colo-0", "colocated", KVRAIL_DISAGGREGATION_MODE="colocated")
        for worker_id in p.procs:
            p.wait_ready(worker_id)
        yield p
        for worker_id in p.live():  # a clean SIGTERM exits 0
            proc = p.procs[worker_id]
            proc.stop(grace_s=20)
            assert proc.returncode() == 0, proc.tail()
    finally:
        p.stop()


generate = functools.partial(pool_generate, keys=KEYS)


async def assert_all_blocks_free(nc: NatsClient, pool: Pool, timeout_s: float = 30.0) -> None:
    await pool.assert_all_blocks_free(nc, timeout_s)


@pytest.fixture
async def nc(pool: Pool) -> NatsClient:
    client = await connect(pool.settings, "test-client")
    yield client  # type: ignore[misc]
    await client.close()


async def test_remote_prefill_decodes_exactly_like_a_colocated_worker(
    pool: Pool, nc: NatsClient
) -> None:
    token_ids = prompt(LONG_PROMPT, seed=1)
    colocated = await generate(nc, "colo-0", token_ids)
    disaggregated = await generate(nc, "decode-0", token_ids)
    assert colocated[0].prefill_mode == "local"
    assert disaggregated[0].prefill_mode == "remote"
    assert len(tokens_of(colocated)) == 8
    assert tokens_of(disaggregated) == tokens_of(colocated)
    assert disaggregated[-1].output.finish_reason == "length"
    stages = disaggregated[0].stages
    assert stages is not None and stages.prefill_compute_s > 0 and stages.validation_s > 0
    await assert_all_blocks_free(nc, pool)
    decode_metrics = scrape(pool.metrics_ports["decode-0"])
    assert 'kvrail_ttft_stage_seconds_count{stage="copy"} 1.0' in decode_metrics
    assert 'kvrail_kv_transfer_bytes_total{transport="nixl-ucx"} 7.3728e+06' in scrape(
        pool.metrics_ports["prefill-0"]
    )


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


PICKER_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc")  # fmt: skip


def picker_view(port: int) -> dict[str, float]:
    """The gauges GAIE's and llm-d's endpoint pickers read by default, parsed from the text
    format as they parse it: one series each, labelled with the configured model name, its
    name unquoted (GAIE's parser validates names by the classic, pre-UTF-8 rules)."""
    text, view = scrape(port), {}
    for name in PICKER_GAUGES:
        assert f'\n{name}{{model_name="{SERVED_NAME}"}} ' in text, text
    for family in text_string_to_metric_families(text):
        if family.name in PICKER_GAUGES:
            assert family.type == "gauge", family
            (sample,) = family.samples
            assert sample.labels == {"model_name": SERVED_NAME}, sample
            view[family.name] = sample.value
    assert set(view) == set(PICKER_GAUGES), view
    return view


async def test_a_decode_worker_serves_the_load_other_gateways_pickers_read(
    pool: Pool, nc: NatsClient
) -> None:
    port = pool.metrics_ports["decode-0"]
    decoding = asyncio.Event()
    running = asyncio.create_task(
        generate(nc, "decode-0", prompt(SHORT_PROMPT, seed=61), max_tokens=400,
                 request_id="picker-gauges", started=decoding)
    )  # fmt: skip
    await asyncio.wait_for(decoding.wait(), 30)
    deadline = time.monotonic() + 10  # the gauges follow the engine about every second
    while (view := picker_view(port))["vllm:num_requests_running"] < 1:
        assert time.monotonic() < deadline and not running.done(), view
        await asyncio.sleep(0.2)
    assert view["vllm:num_requests_waiting"] >= 0
    assert 0 < view["vllm:kv_cache_usage_perc"] <= 1  # a fraction, as vLLM's
    await nc.publish(KEYS.cancel, Cancel(request_id="picker-gauges").encode())
    assert (await asyncio.wait_for(running, 30))[-1].output.error == "cancelled"
    await assert_all_blocks_free(nc, pool)
    idle = {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
            "vllm:kv_cache_usage_perc": 0}  # fmt: skip
    deadline = time.monotonic() + 10
    while (view := picker_view(port)) != idle:
        assert time.monotonic() < deadline, view
        await asyncio.sleep(0.2)


async def test_a_seeded_request_samples_the_same_tokens_remote_or_colocated(
    pool: Pool, nc: NatsClient
) -> None:
    """The prefill worker draws the first token and the decode worker the rest: each draw is
    seeded from the request's seed and its position, so the text does not depend on where the
    prompt was prefilled (it did: the decode worker drew token 2 from the stream's start)."""
    token_ids = prompt(LONG_PROMPT, seed=3)

    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)

    colocated = await generate(nc, "colo-0", token_ids, sampling=seeded(1234))
    disaggregated = await generate(nc, "decode-0", token_ids, sampling=seeded(1234))
    assert colocated[0].prefill_mode == "local" and disaggregated[0].prefill_mode == "remote"
    assert len(tokens_of(colocated)) == 12
    assert tokens_of(disaggregated) == tokens_of(colocated)
    other = await generate(nc, "colo-0", token_ids, sampling=seeded(1235))
    assert tokens_of(other) != tokens_of(colocated)  # it really samples
    await assert_all_blocks_free(nc, pool)


async def test_logprobs_are_the_same_remote_or_colocated_the_first_token_included(
    pool: Pool, nc: NatsClient
) -> None:
    """The prefill worker computes the first token's logprobs and sends them with the KV; the
    decode worker the rest: every token's entry equals a colocated worker's."""
    token_ids = prompt(LONG_PROMPT, seed=4)
    asked = SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True)
    colocated = await generate(nc, "colo-0", token_ids, sampling=asked)
    disaggregated = await generate(nc, "decode-0", token_ids, sampling=asked)
    assert disaggregated[0].prefill_mode == "remote"
    local = [lp for e in colocated for lp in e.output.logprobs]
    remote = [lp for e in disaggregated for lp in e.output.logprobs]
    assert len(local) == len(remote) == 6
    assert [lp.token_id for lp in remote] == [lp.token_id for lp in local] == tokens_of(colocated)
    for a, b in zip(local, remote, strict=True):
        assert a.top_token_ids == b.top_token_ids and len(a.top_token_ids) == 3
        assert abs(a.logprob - b.logprob) < 1e-4
        assert all(abs(x - y) < 1e-4 for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True))
    await assert_all_blocks_free(nc, pool)


async def test_prompt_logprobs_are_the_same_remote_or_colocated(pool: Pool, nc: NatsClient) -> None:
    """The prefill worker scores the prompt and sends the scores with the KV: the decode
    worker's first output carries the same entries as a colocated worker's."""
    token_ids = prompt(LONG_PROMPT, seed=11)
    asked = SamplingParams(max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    colocated = await generate(nc, "colo-0", token_ids, sampling=asked)
    disaggregated = await generate(nc, "decode-0", token_ids, sampling=asked)
    assert disaggregated[0].prefill_mode == "remote"
    local = colocated[0].output.prompt_logprobs
    remote = disaggregated[0].output.prompt_logprobs
    assert [lp.token_id for lp in remote] == [lp.token_id for lp in local] == list(token_ids[1:])
    for a, b in zip(local, remote, strict=True):
        assert a.top_token_ids == b.top_token_ids and len(a.top_token_ids) == 2
        assert abs(a.logprob - b.logprob) < 1e-4
    assert all(not e.output.prompt_logprobs for e in colocated[1:] + disaggregated[1:])
    await assert_all_blocks_free(nc, pool)


async def test_a_grammar_gives_the_same_tokens_remote_or_colocated(
    pool: Pool, nc: NatsClient
) -> None:
    """The prefill worker samples the first token under the grammar and sends only the token;
    the decode worker rebuilds the grammar's state by replaying it: the same valid JSON as a
    colocated worker's, seeded. A grammar a worker cannot compile fails its request as
    `invalid_request` before any block is reserved or job published."""
    import json

    import jsonschema
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    from kvrail.model_files import resolve
    from kvrail.worker.models.loader import prepare

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "rank": {"type": "integer", "minimum": 1, "maximum": 9},
            "kind": {"enum": ["port", "capital", "village"]},
        },
        "required": ["city", "rank", "kind"],
        "additionalProperties": False,
    }
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    asked = SamplingParams(max_tokens=60, temperature=1.0, seed=9, grammar=grammar)
    token_ids = prompt(LONG_PROMPT, seed=21)
    colocated = await generate(nc, "colo-0", token_ids, sampling=asked)
    disaggregated = await generate(nc, "decode-0", token_ids, sampling=asked)
    assert colocated[0].prefill_mode == "local" and disaggregated[0].prefill_mode == "remote"
    assert tokens_of(disaggregated) == tokens_of(colocated)
    assert disaggregated[-1].output.finish_reason == "stop"
    tokenizer = AutoTokenizer.from_pretrained(prepare(resolve("smollm2")))
    text = tokenizer.decode(tokens_of(colocated), skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    garbage = replace(asked, grammar="start: ( {{")
    for worker_id in ("decode-0", "colo-0"):
        events = await generate(nc, worker_id, token_ids, sampling=garbage)
        assert [e.output.error for e in events] == ["invalid_request"]
    await assert_all_blocks_free(nc, pool)


async def test_a_short_prompt_is_prefilled_on_the_decode_worker(pool: Pool, nc: NatsClient) -> None:
    token_ids = prompt(SHORT_PROMPT, seed=2)
    local = await generate(nc, "decode-0", token_ids, max_tokens=5)
    colocated = await generate(nc, "colo-0", token_ids, max_tokens=5)
    assert local[0].prefill_mode == "local"
    assert tokens_of(local) == tokens_of(colocated)
    await assert_all_blocks_free(nc, pool)


async def test_a_request_past_its_deadline_fails_cleanly_and_frees_everything(
    pool: Pool, nc: NatsClient
) -> None:
    events = await generate(nc, "decode-0", prompt(LONG_PROMPT, seed=3), deadline_s=-1.0)
    assert events[-1].output.error == "deadline"
    await assert_all_blocks_free(nc, pool)


async def test_a_cancel_releases_a_request_while_its_kv_is_remote_or_decoding(
    pool: Pool, nc: NatsClient
) -> None:
    queue = PrefillQueue(nc.jetstream(), KEYS)
    # max_tokens leaves the request running long after its prefill: if the prefill worker wins
    # the race with the cancel, the cancel lands while decoding, never after the finish.
    remote = asyncio.create_task(
        generate(nc, "decode-0", prompt(LONG_PROMPT, seed=8), max_tokens=400,
                 request_id="cancel-remote")
    )  # fmt: skip
    await wait_for_job(queue)
    await nc.publish(KEYS.cancel, Cancel(request_id="cancel-remote").encode())
    events = await asyncio.wait_for(remote, 30)
    assert events[-1].output.error == "cancelled"
    decoding = asyncio.Event()
    local = asyncio.create_task(
        generate(nc, "decode-0", prompt(SHORT_PROMPT, seed=9), max_tokens=400,
                 request_id="cancel-local", started=decoding)
    )  # fmt: skip
    # The cancel goes once the worker streams, so it lands mid-decode (a cancel that overtakes
    # its request is covered by the next test).
    await asyncio.wait_for(decoding.wait(), 30)
    await nc.publish(KEYS.cancel, Cancel(request_id="cancel-local").encode())
    events = await asyncio.wait_for(local, 30)
    assert events[-1].output.error == "cancelled"
    # Well before the 30 s deadline: the prefill worker's refusal (or its late completion)
    # lifts the quarantine of the remote request's blocks.
    await assert_all_blocks_free(nc, pool, timeout_s=15.0)


async def test_a_cancel_that_overtakes_its_request_ends_it_at_once(
    pool: Pool, nc: NatsClient
) -> None:
    """The client leaves right after sending: the router's cancel reaches the workers before
    the request. The decode worker remembers it and ends the request as cancelled on arrival
    (without it, the request ran to max_tokens); a prefill job with that id is refused."""
    for request_id, token_ids in (
        ("early-remote", prompt(LONG_PROMPT, seed=51)),
        ("early-local", prompt(SHORT_PROMPT, seed=52)),
    ):
        await nc.publish(KEYS.cancel, Cancel(request_id=request_id).encode())
        await nc.flush()
        # Lets the worker take the cancel first. Should the request still win the race, it is
        # cancelled while running, which these checks accept too.
        await asyncio.sleep(0.5)
        started = time.monotonic()
        events = await asyncio.wait_for(
            generate(nc, "decode-0", token_ids, max_tokens=400, request_id=request_id), 30
        )
        assert time.monotonic() - started < 10.0
        assert events[-1].output.error == "cancelled"
        assert not tokens_of_any(events)
    port, rejected = pool.metrics_ports["prefill-0"], "kvrail_prefill_jobs_rejected_total"
    before = counter(port, rejected, "cancelled")
    dest = (await pool.records())["decode-0"]
    await nc.publish(KEYS.cancel, Cancel(request_id="early-job").encode())
    await nc.flush()
    queue = PrefillQueue(nc.jetstream(), KEYS)
    assert await queue.publish(job_for(dest, "early-job", prompt(40, seed=53), (5, 6, 7)))
    deadline = time.monotonic() + 20
    while counter(port, rejected, "cancelled") < before + 1:
        assert time.monotonic() < deadline, scrape(port)
        await asyncio.sleep(0.2)
    await assert_all_blocks_free(nc, pool, timeout_s=15.0)


def job_for(
    dest: WorkerRecord, request_id: str, token_ids: tuple[int, ...], block_ids: tuple[int, ...]
) -> PrefillJob:
    """A prefill job for `dest`, as a decode worker would publish it (valid for 30 s)."""
    return PrefillJob(
        request_id=request_id, token_ids=token_ids, fingerprint=dest.fingerprint,
        dest_worker_id=dest.worker_id, dest_incarnation=dest.incarnation,
        dest_agent_name=dest.nixl_agent_name, dest_block_ids=block_ids, first_block_index=0,
        deadline_unix_s=time.time() + 30, sampling=SamplingParams(max_tokens=1),
    )  # fmt: skip


async def test_the_prefill_worker_drops_stale_jobs_without_running_them(
    pool: Pool, nc: NatsClient
) -> None:
    records = await pool.records()
    dest = records["decode-0"]
    queue = PrefillQueue(nc.jetstream(), KEYS)
    base = job_for(dest, "stale-0", prompt(40, seed=10), (5, 6, 7))
    for request_id, changes in (
        ("stale-deadline", {"deadline_unix_s": time.time() - 1}),
        ("stale-incarnation", {"dest_incarnation": dest.incarnation - 1}),
        ("stale-fingerprint", {"fingerprint": "0" * 64}),
    ):
        assert await queue.publish(replace(base, request_id=request_id, **changes))
    want = [f'kvrail_prefill_jobs_rejected_total{{reason="{r}"}} 1.0'
            for r in ("deadline", "stale_destination", "fingerprint")]  # fmt: skip
    deadline = time.monotonic() + 20
    while not all(w in scrape(pool.metrics_ports["prefill-0"]) for w in want):
        assert time.monotonic() < deadline, scrape(pool.metrics_ports["prefill-0"])
        await asyncio.sleep(0.2)
    assert await queue.backlog() == 0
    await assert_all_blocks_free(nc, pool)


def counter(port: int, name: str, reason: str) -> float:
    """The value of `name{reason="..."}` in a worker's metrics (0 when absent)."""
    prefix = f'{name}{{reason="{reason}"}} '
    for line in scrape(port).splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


async def test_hostile_jobs_are_refused_counted_and_touch_no_other_request(
    pool: Pool, nc: NatsClient
) -> None:
    """Jobs a buggy or hostile publisher puts on the queue, while a genuine request decodes on
    the same decode worker: blocks the decode worker never reserved for them (in range or not),
    undecodable or truncated payloads, a prompt longer than the model allows, and a replay of
    a completed job. The prefill worker refuses and counts every one; the decode worker grants
    none of their writes; the genuine request's tokens are exactly what they are alone."""
    prefill, decode_ = pool.metrics_ports["prefill-0"], pool.metrics_ports["decode-0"]
    rejected, refused = "kvrail_prefill_jobs_rejected_total", "kvrail_kv_write_grants_refused_total"
    reasons = ("invalid", "invalid_request", "not_granted_not_waiting", "duplicate")
    before = {r: counter(prefill, rejected, r) for r in reasons}
    grants_before = counter(decode_, refused, "not_waiting")
    victim_prompt = prompt(LONG_PROMPT, seed=41)
    done_id = f"done-{uuid.uuid4().hex[:8]}"
    alone = tokens_of(await generate(nc, "decode-0", victim_prompt, max_tokens=24,
                                     request_id=done_id))  # fmt: skip
    victim = asyncio.create_task(generate(nc, "decode-0", victim_prompt, max_tokens=24))
    dest = (await pool.records())["decode-0"]
    base = job_for(dest, "hostile-0", prompt(40, seed=61), (1, 2, 3))
    too_long = prompt(2000, seed=62)  # max_model_len is 1024
    jobs = [
        replace(base, request_id="hostile-foreign"),
        replace(base, request_id="hostile-out-of-range", dest_block_ids=(90_000, 90_001, 90_002)),
        replace(base, request_id="hostile-too-long", token_ids=too_long,
                dest_block_ids=tuple(range(1, 126))),
        replace(base, request_id=done_id, token_ids=victim_prompt,
                dest_block_ids=tuple(range(1, 11))),  # a replay of the completed job
    ]  # fmt: skip
    payloads = [base.encode()[:-25], b"\x00\xff not json", Cancel("x").encode()]
    js = nc.jetstream()
    for i, data in enumerate([*(j.encode() for j in jobs), *payloads]):
        await js.publish(KEYS.prefill_any, data, stream=KEYS.prefill_stream,
                         headers={"Nats-Msg-Id": f"hostile-{uuid.uuid4().hex}-{i}"})  # fmt: skip
    want = {"invalid": 3, "invalid_request": 1, "not_granted_not_waiting": 2, "duplicate": 1}
    deadline = time.monotonic() + 30
    while any(counter(prefill, rejected, r) - before[r] < n for r, n in want.items()):
        assert time.monotonic() < deadline, scrape(prefill)
        await asyncio.sleep(0.2)
    assert {r: counter(prefill, rejected, r) - before[r] for r in reasons} == want
    assert counter(decode_, refused, "not_waiting") - grants_before == 2
    assert tokens_of(await asyncio.wait_for(victim, 30)) == alone
    assert await PrefillQueue(js, KEYS).backlog() == 0
    await assert_all_blocks_free(nc, pool)


async def test_workers_publish_kv_events_and_answer_their_kv_state(
    pool: Pool, nc: NatsClient
) -> None:
    records = await pool.records()
    dest, prefill = records["decode-0"], records["prefill-0"]
    assert dest.block_size == prefill.block_size == 16
    token_ids = prompt(LONG_PROMPT, seed=12)
    expected = {h.hex() for h in block_hashes(token_ids, 16, root_hash(dest.fingerprint))}
    assert len(expected) == LONG_PROMPT // 16
    received: dict[str, list[KvEvent]] = {}
    sub = await nc.subscribe(KEYS.kv_events_all)  # events first, then the state (the contract)
    await nc.flush()
    try:
        events = await generate(nc, "decode-0", token_ids)
        assert events[0].prefill_mode == "remote"
        deadline = time.monotonic() + 10
        while not all(expected <= stored_by(received, w) for w in ("decode-0", "prefill-0")):
            msg = await sub.next_msg(timeout=max(deadline - time.monotonic(), 0.01))
            event = decode(msg.data, KvEvent)
            assert msg.subject == KEYS.kv_events(event.worker_id)
            received.setdefault(event.worker_id, []).append(event)
    finally:
        await sub.unsubscribe()
    for worker_id, record in (("decode-0", dest), ("prefill-0", prefill)):
        seqs = [e.seq for e in received[worker_id]]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # no gap, no reorder
        assert {e.incarnation for e in received[worker_id]} == {record.incarnation}
        reply = await nc.request(KEYS.kv_state(worker_id), b"", timeout=5)
        state = decode(reply.data, KvEvent)
        assert state.cleared and state.worker_id == worker_id and not state.removed
        assert state.incarnation == record.incarnation and state.seq >= seqs[-1]
        assert expected <= set(state.stored)
    await assert_all_blocks_free(nc, pool)


async def test_a_remote_prefill_goes_to_the_prefill_worker_the_router_named(
    pool: Pool, nc: NatsClient
) -> None:
    """`GenerateRequest.prefill_worker_id` (the router's pick: a prefill worker holding more of
    the prompt's prefix) takes every job named for it; a name no longer registered falls back
    to the shared queue. The tokens are the colocated worker's either way."""
    pool.start("prefill-1", "prefill")
    await asyncio.to_thread(pool.wait_ready, "prefill-1")
    ids = [f"pn-{uuid.uuid4().hex[:8]}" for _ in range(4)]
    for i, request_id in enumerate(ids):
        token_ids = prompt(LONG_PROMPT, seed=61 + i)
        events = await generate(nc, "decode-0", token_ids, request_id=request_id,
                                prefill_worker_id="prefill-1")  # fmt: skip
        assert events[0].prefill_mode == "remote"
        assert tokens_of(events) == tokens_of(await generate(nc, "colo-0", token_ids))
    logs = {name: pool.procs[name].log_path.read_text() for name in ("prefill-0", "prefill-1")}
    for request_id in ids:
        assert f"request_id={request_id} " in logs["prefill-1"]
        assert f"request_id={request_id} " not in logs["prefill-0"]
    gone = await generate(nc, "decode-0", prompt(LONG_PROMPT, seed=65), prefill_worker_id="p-9")
    assert gone[0].prefill_mode == "remote" and gone[-1].output.error is None
    await assert_all_blocks_free(nc, pool)
    await asyncio.to_thread(pool.procs["prefill-1"].stop, 20)


def stored_by(received: dict[str, list[KvEvent]], worker_id: str) -> set[str]:
    """What a router learned of one worker's cache from the events it received."""
    cached: set[str] = set()
    for event in received.get(worker_id, []):
        cached.difference_update(event.removed)
        cached.update(event.stored)
    return cached


async def wait_for_job(queue: PrefillQueue, num_jobs: int = 1, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await queue.backlog() < num_jobs:
        assert time.monotonic() < deadline, "no prefill job was queued"
        await asyncio.sleep(0.005)


async def test_a_block_corrupted_in_flight_is_caught_and_recomputed(
    pool: Pool, nc: NatsClient
) -> None:
    """A decode worker that flips a byte of every block it receives (fault injection) must not
    decode from it: the checksum refuses the transfer and the recompute policy prefills locally,
    so the tokens are still exactly the colocated worker's."""
    pool.start("decode-bad", "decode", KVRAIL_FAULT_CORRUPT_KV_TRANSFERS="1")
    await asyncio.to_thread(pool.wait_ready, "decode-bad")
    token_ids = prompt(LONG_PROMPT, seed=21)
    colocated = await generate(nc, "colo-0", token_ids)
    events = await generate(nc, "decode-bad", token_ids)
    assert events[0].prefill_mode == "recompute"
    assert tokens_of(events) == tokens_of(colocated)
    log_text = pool.procs["decode-bad"].log_path.read_text()
    assert "fault injection: corrupting a received block" in log_text
    assert "completion refused" in log_text and "reason=checksum" in log_text
    await assert_all_blocks_free(nc, pool)
    await asyncio.to_thread(pool.procs["decode-bad"].stop, 20)


async def test_reroute_retries_on_another_prefill_worker_then_fails_cleanly(
    pool: Pool, nc: NatsClient
) -> None:
    """kvLoadFailurePolicy reroute: a transfer refused by validation (every received block is
    corrupted by fault injection here) is retried once on a different prefill worker, within
    the deadline; when that fails too the request ends with a clean error and frees everything."""
    pool.start("prefill-1", "prefill")
    pool.start("decode-rr", "decode", KVRAIL_KV_LOAD_FAILURE_POLICY="reroute",
               KVRAIL_FAULT_CORRUPT_KV_TRANSFERS="1")  # fmt: skip
    for name in ("prefill-1", "decode-rr"):
        await asyncio.to_thread(pool.wait_ready, name)
    request_id = f"rr-{uuid.uuid4().hex[:8]}"
    events = await generate(nc, "decode-rr", prompt(LONG_PROMPT, seed=31), request_id=request_id)
    assert events[-1].output.error == "kv_invalid" and not tokens_of_any(events)
    writers = {name: pool.procs[name].log_path.read_text() for name in ("prefill-0", "prefill-1")}
    first = [n for n, text in writers.items() if f"request_id={request_id} " in text]
    second = [n for n, text in writers.items() if f"request_id={request_id}~r1 " in text]
    assert len(first) == 1 and len(second) == 1 and first != second, (first, second)
    await assert_all_blocks_free(nc, pool)
    for name in ("decode-rr", "prefill-1"):
        await asyncio.to_thread(pool.procs[name].stop, 20)


async def test_a_failed_write_is_handed_over_to_another_prefill_worker(
    pool: Pool, nc: NatsClient
) -> None:
    """A prefill worker whose KV writes all fail (fault injection) hands each job over to a
    different prefill worker instead of retrying it itself; the request is still prefilled
    remotely and decodes exactly like the colocated worker. Which worker takes a job from the
    shared queue is up to the server, so requests go until one landed on the failing worker."""
    bad = pool.start("prefill-bad", "prefill", KVRAIL_FAULT_FAIL_KV_WRITES="1")
    await asyncio.to_thread(pool.wait_ready, "prefill-bad")
    for attempt in range(16):
        token_ids = prompt(LONG_PROMPT, seed=51 + attempt)
        events = await generate(nc, "decode-0", token_ids)
        assert events[0].prefill_mode == "remote" and events[-1].output.error is None
        if "handed_to=prefill-0" in bad.log_path.read_text():
            break
    else:
        raise AssertionError(f"no job reached prefill-bad in 16 requests\n{bad.tail()}")
    assert tokens_of(events) == tokens_of(await generate(nc, "colo-0", token_ids))
    assert "fault injection: failing a KV write" in bad.log_path.read_text()
    await assert_all_blocks_free(nc, pool)
    await asyncio.to_thread(bad.stop, 20)


def tokens_of_any(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.output.token_ids]


async def test_a_worker_that_cannot_use_rdma_where_the_pool_requires_it_is_never_ready(
    pool: Pool, nc: NatsClient
) -> None:
    """No RDMA device here (or no UCX_TLS restricted to RDMA): with `rdma: required` the worker
    registers, says why it is not ready, never becomes ready, and stops cleanly."""
    proc = pool.start("decode-rdma", "decode", KVRAIL_RDMA="required")
    deadline = time.monotonic() + 120
    while "worker not ready" not in proc.log_path.read_text():
        assert proc.is_running() and time.monotonic() < deadline, proc.tail()
        await asyncio.sleep(0.2)
    assert "reason=rdma is required but" in proc.log_path.read_text()
    assert not (await pool.records())["decode-rdma"].is_ready
    await asyncio.to_thread(proc.stop, 20)
    assert proc.returncode() == 0


async def test_killing_the_decode_worker_mid_request_leaves_the_prefill_side_clean(
    pool: Pool, nc: NatsClient
) -> None:
    """Killed mid-answer, under a grammar (its matcher dies with it): the request cannot be
    rescued (the router fails it as `worker_lost`), and nothing leaks on the prefill side."""
    from llguidance import LLMatcher

    note = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 3000}},
            "required": ["text"]}  # fmt: skip
    asked = SamplingParams(max_tokens=1000, temperature=1.0, seed=4,
                           grammar=LLMatcher.grammar_from_json_schema(note))  # fmt: skip
    decoding = asyncio.Event()
    answer = asyncio.create_task(
        generate(nc, "decode-1", prompt(LONG_PROMPT, seed=4), deadline_s=15, sampling=asked,
                 started=decoding)
    )  # fmt: skip
    await asyncio.wait_for(decoding.wait(), 30)
    pool.kill("decode-1")
    answer.cancel()
    # It comes back with the `fail` policy (the last test needs one).
    pool.start("decode-1", "decode", KVRAIL_KV_LOAD_FAILURE_POLICY="fail")
    await assert_all_blocks_free(nc, pool, timeout_s=25.0)
    assert pool.procs["prefill-0"].is_running()
    # The prefill worker still serves the others, and the restarted worker (a new incarnation,
    # so a new NIXL agent under the same worker id) once it registers.
    events = await generate(nc, "decode-0", prompt(LONG_PROMPT, seed=5))
    assert events[0].prefill_mode == "remote" and events[-1].output.error is None
    await asyncio.to_thread(pool.wait_ready, "decode-1")
    events = await generate(nc, "decode-1", prompt(LONG_PROMPT, seed=7))
    assert events[0].prefill_mode == "remote" and events[-1].output.error is None
    await assert_all_blocks_free(nc, pool)


async def test_killing_the_prefill_worker_mid_job_recomputes_or_fails_by_policy(
    pool: Pool, nc: NatsClient
) -> None:
    token_ids = prompt(LONG_PROMPT, seed=6)
    expected = tokens_of(await generate(nc, "colo-0", token_ids))
    queue = PrefillQueue(nc.jetstream(), KEYS)
    recompute = asyncio.create_task(generate(nc, "decode-0", token_ids, deadline_s=15))
    fail = asyncio.create_task(generate(nc, "decode-1", prompt(LONG_PROMPT, 11), deadline_s=15))
    await wait_for_job(queue, num_jobs=2)
    pool.kill("prefill-0")
    started = time.monotonic()
    events = await asyncio.wait_for(recompute, timeout=25)
    assert events[0].prefill_mode == "recompute"  # decode-0: kvLoadFailurePolicy recompute
    assert tokens_of(events) == expected
    assert time.monotonic() - started < 15
    events = await asyncio.wait_for(fail, timeout=25)  # decode-1: kvLoadFailurePolicy fail
    assert len(events) == 1 and events[0].output.error == "prefill_worker_lost"
    assert events[0].output.token_ids == ()
    await assert_all_blocks_free(nc, pool, timeout_s=25.0)
