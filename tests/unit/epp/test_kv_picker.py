"""kvrail.epp.kv_picker: the router's choice, made by the router's own code, over a real
``WorkerView`` (records and KV state applied as etcd and NATS would deliver them) and the real
SmolLM2 tokenizer; the endpoint always from the worker's record, bookings per stream."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvrail.epp import kv_picker
from kvrail.epp.kv_picker import KvAwarePicker
from kvrail.epp.picker import NoEndpoint, PickRequest, Refused, Routed
from kvrail.keys import PoolKeys
from kvrail.messages import KvEvent, WorkerRecord
from kvrail.router.discovery.index import prompt_hashes
from kvrail.router.discovery.view import WorkerView
from kvrail.router.generate import RouterState
from kvrail.router.metrics import RouterMetrics
from kvrail.router.policy import Chooser
from kvrail.router.streams.dispatcher import Dispatcher
from kvrail.router.streams.job import Job
from kvrail.router.tenants import Admission, TenantTable
from kvrail.router.text.threads import TokenizerThreads
from kvrail.router.text.tokenizer import TextCodec
from kvrail.sampling import SamplingParams
from kvrail.settings import default_cache_dir

FINGERPRINT = "f" * 64
BLOCK_SIZE = 16
CHAT = "/v1/chat/completions"
LONG = "Tell me everything about the history of the Roman aqueducts. " * 12
KEYS = {"tenants": {"team-a": {"keys": ["sk-a"]}, "team-b": {"keys": ["sk-b"]}}}


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.load("smollm2", default_cache_dir())


@pytest.fixture
def threads() -> Iterator[TokenizerThreads]:
    pool = TokenizerThreads(2, name="epp-test-tokenize")
    yield pool
    pool.shutdown()


class _Unconnected:
    """What a dispatcher asks of its NATS client when made (an inbox name); choosing sends
    nothing."""

    def new_inbox(self) -> str:
        return "_INBOX.unit"


def make_state(codec: TextCodec, threads: TokenizerThreads, tenants: Any = None) -> RouterState:
    keys = PoolKeys("default", "unit")
    view = WorkerView(None, None, keys)  # type: ignore[arg-type]  # never started: fed below
    view.ready.set()
    dispatcher = Dispatcher(_Unconnected(), keys, view, Chooser("kv-aware"), BLOCK_SIZE)  # type: ignore[arg-type]
    return RouterState(
        codec=codec, dispatcher=dispatcher, view=view, tenants=tenants or TenantTable(),
        admission=Admission(), metrics=RouterMetrics(), served_name="smollm2",
        max_model_len=0, request_timeout_s=10, tokenizer=threads,
    )  # fmt: skip


def add_worker(
    state: RouterState, worker_id: str, front: str, cached: tuple[str, ...] = ()
) -> None:
    """A ready decode worker's record, its KV state (the `cached` block hashes) loaded first, as
    a state reply would (so the view starts no fetch)."""
    state.view.index.load_state(
        KvEvent(worker_id=worker_id, incarnation=1, seq=0, stored=cached, cleared=True)
    )
    record = WorkerRecord(
        worker_id=worker_id, pod_uid=f"uid-{worker_id}", incarnation=1, role="colocated",
        fingerprint=FINGERPRINT, block_size=BLOCK_SIZE, max_model_len=2048, is_ready=True,
        http_front=front,
    )  # fmt: skip
    state.view._apply_record(worker_id, record)


def chat_body(content: str = LONG, model: str = "smollm2") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}]}).encode()


def request(stream_id: int, body: bytes, path: str = CHAT, eligible: Any = None,
            **headers: str) -> PickRequest:  # fmt: skip
    return PickRequest(stream_id, {":path": path, "content-type": "application/json", **headers},
                       body, eligible)  # fmt: skip


def cached_blocks(codec: TextCodec, content: str = LONG, salt: str = "") -> tuple[str, ...]:
    ids = codec.chat_prompt([{"role": "user", "content": content}])
    return tuple(prompt_hashes(ids, BLOCK_SIZE, FINGERPRINT, salt))


def pick(picker: KvAwarePicker, req: PickRequest) -> Any:
    return asyncio.run(picker.pick(req))


def test_the_worker_caching_the_prompt_is_picked_and_the_others_follow(
    codec: TextCodec, threads: TokenizerThreads
) -> None:
    state = make_state(codec, threads)
    add_worker(state, "w-a", "10.0.0.1:8000")
    add_worker(state, "w-b", "10.0.0.2:8000", cached_blocks(codec))
    add_worker(state, "w-c", "10.0.0.3:8000")
    picker = KvAwarePicker(state, num_endpoints=2)
    result = pick(picker, request(1, chat_body()))
    assert isinstance(result, Routed)
    assert result.endpoints[0] == "10.0.0.2:8000"
    assert len(result.endpoints) == 2 and "10.0.0.2:8000" not in result.endpoints[1:]
    assert state.dispatcher.in_flight == {"w-b": 1}
    picker.finished(1)
    picker.finished(1)  # idempotent
    assert state.dispatcher.in_flight == {} and picker.booked == {}


def test_bookings_weigh_as_load_so_equal_workers_share_requests(
    codec: TextCodec, threads: TokenizerThreads
) -> None:
    state = make_state(codec, threads)
    add_worker(state, "w-a", "10.0.0.1:8000")
    add_worker(state, "w-b", "10.0.0.2:8000")
    picker = KvAwarePicker(state)
    first = pick(picker, request(1, chat_body("hi")))
    second = pick(picker, request(2, chat_body("hi")))
    assert {first.endpoints[0], second.endpoints[0]} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert state.dispatcher.in_flight == {"w-a": 1, "w-b": 1}
    picker.finished(1)
    picker.finished(2)
    assert state.dispatcher.in_flight == {}


def test_the_served_endpoint_moves_the_booking_to_its_worker(
    codec: TextCodec, threads: TokenizerThreads
) -> None:
    state = make_state(codec, threads)
    add_worker(state, "w-a", "10.0.0.1:8000", cached_blocks(codec))
    add_worker(state, "w-b", "10.0.0.2:8000")
    picker = KvAwarePicker(state)
    assert pick(picker, request(1, chat_body())).endpoints[0] == "10.0.0.1:8000"
    picker.served(1, "10.0.0.2:8000")
    assert state.dispatcher.in_flight == {"w-b": 1}
    picker.served(1, "10.9.9.9:8000")  # no worker's front: the booking stays
    assert state.dispatcher.in_flight == {"w-b": 1}
    picker.finished(1)
    assert state.dispatcher.in_flight == {}


@pytest.mark.parametrize(
    ("body", "headers", "status", "expected"),
    [
        (b"{not json", {}, 400, {"code": "invalid_json"}),
        (b"", {}, 400, {"code": "missing_body"}),
        (chat_body(model="gpt-4o"), {}, 404, {"code": "model_not_found", "param": "model"}),
        (json.dumps({"model": "smollm2", "messages": "hi"}).encode(), {}, 400,
         {"param": "messages"}),
        (b"plain text", {"content-type": "text/plain"}, 400, {"type": "invalid_request_error"}),
    ],
)  # fmt: skip
def test_a_bad_request_is_refused_as_the_router_refuses_it_and_books_nothing(
    codec: TextCodec, threads: TokenizerThreads, caplog: pytest.LogCaptureFixture,
    body: bytes, headers: dict[str, str], status: int, expected: dict[str, str],
) -> None:  # fmt: skip
    state = make_state(codec, threads)
    add_worker(state, "w-a", "10.0.0.1:8000")
    picker = KvAwarePicker(state)
    caplog.set_level("DEBUG")
    result = pick(picker, request(1, body, **headers))
    assert isinstance(result, Refused)
    assert result.status == status
    error = result.error["error"]
    assert isinstance(error, dict) and error["message"]
    assert {k: error[k] for k in expected} == expected
    assert state.dispatcher.in_flight == {} and picker.booked == {}
    assert f"status={status}" in caplog.text
    assert "not json" not in caplog.text and "plain text" not in caplog.text


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_tokenized(
    codec: TextCodec, threads: TokenizerThreads
) -> None:
    state = make_state(codec, threads)
    add_worker(state, "w-a", "10.0.0.1:8000")
    used: list[str] = []
    original = codec.chat_prompt
    codec.chat_prompt = lambda *a: used.append(threading.current_thread().name) or original(*a)  # type: ignore[method-assign]
    try:
        result = pick(KvAwarePicker(state), request(1, chat_body("word " * 100_000)))
        assert isinstance(result, Refused) and result.status == 400
        assert result.error["error"]["code"] == "context_length_exceeded"  # type: ignore[index]
        assert used == []
        assert isinstance(pick(KvAwarePicker(state), request(2, chat_body("hi"))), Routed)
        assert used and all(name.startswith("epp-test-tokenize") for name in used)
    finally:
        del codec.chat_prompt  # type: ignore[method-assign]


def test_completions_are_tokenized_and_other_paths_go_by_load(
    codec: TextCodec, threads: TokenizerThreads
) -> None:
    state = make_state(codec, threads)
    text = "Once upon a time in a land far away " * 20
    ids = codec.encode(text)
    add_worker(state, "w-a", "10.0.0.1:8000")
    add_worker(state, "w-b", "10.0.0.2:8000", tuple(prompt_hashes(ids, BLOCK_SIZE, FINGERPRINT)))
    picker = KvAwarePicker(state)
    completion = json.dumps({"model": "smollm2", "prompt": text}).encode()
    assert pick(picker, request(1, completion, "/v1/completions")).endpoints[0] == "10.0.0.2:8000"
    picker.finished(1)
    ids_body = json.dumps({"model": "smollm2", "prompt": ids}).encode()
    assert pick(picker, request(2, ids_body, "/v1/completions?x=1")).endpoints[0] == "10.0.0.2:8000"
    # By load alone: w-b has a request booked now.
    assert pick(picker, request(3, b"", "/v1/models")).endpoints[0] == "10.0.0.1:8000"


def test_only_workers_with_a_front_the_subset_allows_are_picked(
    codec: TextCodec, threads: TokenizerThreads
) -> None:
    state = make_state(codec, threads)
    add_worker(state, "w-none", "", cached_blocks(codec))  # caches the prompt, has no front
    add_worker(state, "w-bad", "pod-a:8000", cached_blocks(codec))  # not ip:port
    add_worker(state, "w-a", "10.0.0.1:8000")
    add_worker(state, "w-b", "10.0.0.2:8000")
    picker = KvAwarePicker(state)
    result = pick(picker, request(1, chat_body()))
    assert isinstance(result, Routed)
    assert set(result.endpoints) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    hinted = pick(picker, request(2, chat_body(), eligible=frozenset({"10.0.0.2"})))
    assert hinted.endpoints == ("10.0.0.2:8000",)
    none = pick(picker, request(3, chat_body(), eligible=frozenset({"10.0.0.9:8000"})))
    assert isinstance(none, NoEndpoint) and "eligible" in none.reason


def test_ipv6_fronts_are_named_in_brackets_and_matched_by_the_subset_hint(
    codec: TextCodec, threads: TokenizerThreads
) -> None:
    state = make_state(codec, threads)
    add_worker(state, "w-a", "[fd00::1]:8000", cached_blocks(codec))
    add_worker(state, "w-b", "fd00::2:8000")  # a record written unbracketed is read the same
    picker = KvAwarePicker(state)
    result = pick(picker, request(1, chat_body()))
    assert isinstance(result, Routed)
    assert result.endpoints == ("[fd00::1]:8000", "[fd00::2]:8000")
    hinted = pick(picker, request(2, chat_body(), eligible=frozenset({"fd00::2"})))
    assert hinted.endpoints == ("[fd00::2]:8000",)


def test_no_worker_with_a_front_is_no_endpoint(codec: TextCodec, threads: TokenizerThreads) -> None:
    state = make_state(codec, threads)
    add_worker(state, "w-none", "")
    assert isinstance(pick(KvAwarePicker(state), request(1, chat_body())), NoEndpoint)


def test_api_keys_are_checked_and_the_tenant_salts_the_prefix_match(
    codec: TextCodec, threads: TokenizerThreads
) -> None:
    state = make_state(codec, threads, TenantTable.parse(KEYS))
    add_worker(state, "w-a", "10.0.0.1:8000", cached_blocks(codec, salt="team-a"))
    add_worker(state, "w-b", "10.0.0.2:8000", cached_blocks(codec, salt="team-b"))
    picker = KvAwarePicker(state)
    missing = pick(picker, request(1, chat_body()))
    assert isinstance(missing, Refused) and missing.status == 401
    for stream_id, (key, front) in enumerate((("sk-a", "10.0.0.1:8000"),
                                              ("sk-b", "10.0.0.2:8000")), 2):  # fmt: skip
        result = pick(picker, request(stream_id, chat_body(), authorization=f"Bearer {key}"))
        assert result.endpoints[0] == front
        picker.finished(stream_id)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def report(state: RouterState, worker_id: str, num_running: int) -> None:
    """A newer record of the worker, as its load refresh writes it."""
    record = state.view.records()[worker_id]
    state.view._apply_record(worker_id, dataclasses.replace(record, num_running=num_running))


def test_a_detached_booking_stays_until_the_worker_s_report_counts_the_request(
    codec: TextCodec, threads: TokenizerThreads, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(kv_picker, "time", clock)
    state = make_state(codec, threads)
    add_worker(state, "w-a", "10.0.0.1:8000")
    add_worker(state, "w-b", "10.0.0.2:8000")
    picker = KvAwarePicker(state)
    result = pick(picker, request(1, chat_body("short")))
    assert isinstance(result, Routed)
    (worker,) = state.dispatcher.in_flight
    picker.detached(1)
    picker.finished(1)  # the stream ends at once: the booking stays, handed over
    assert state.dispatcher.in_flight == {worker: 1} and picker.booked == {}

    def load() -> int:
        candidates, _ = state.dispatcher.candidates(probe_job())
        return next(c.load for c in candidates if c.worker_id == worker)

    # A report written before the worker saw the request does not release it.
    clock.now += kv_picker.COUNTED_AFTER_S / 2
    report(state, worker, 0)
    assert state.dispatcher.in_flight == {worker: 1} and load() == 1
    # The first report after COUNTED_AFTER_S counts it: the booking leaves as the report lands,
    # and the request is counted once, by the worker.
    clock.now += kv_picker.COUNTED_AFTER_S
    report(state, worker, 1)
    assert state.dispatcher.in_flight == {} and picker.handed_over == {}
    assert load() == 1


def test_a_handed_over_booking_is_released_after_max_hold_if_the_worker_never_reports(
    codec: TextCodec, threads: TokenizerThreads, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(kv_picker, "time", clock)
    state = make_state(codec, threads)
    add_worker(state, "w-a", "10.0.0.1:8000")
    picker = KvAwarePicker(state)
    assert isinstance(pick(picker, request(1, chat_body("short"))), Routed)
    picker.detached(1)
    picker.finished(1)
    clock.now += kv_picker.MAX_HOLD_S + 0.1
    assert isinstance(pick(picker, request(2, chat_body("short"))), Routed)  # sweeps first
    assert state.dispatcher.in_flight == {"w-a": 1} and picker.booked == {2: "w-a"}
    picker.finished(2)
    assert state.dispatcher.in_flight == {} and picker.handed_over == {}


def probe_job() -> Job:
    return Job("probe", tuple(range(32)), SamplingParams(max_tokens=1), 0.0)
