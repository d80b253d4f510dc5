"""EngineService: the engine on its own thread, driven from asyncio (tiny random Llama)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvrail.errors import DeadlineExceededError, InvalidRequestError
from kvrail.hashing import block_hashes, root_hash
from kvrail.outputs import RequestOutput
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.service import EngineService
from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

PROMPT = list(range(10, 31))  # 21 tokens: 5 full 4-token blocks and a partial one
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


LONG = SamplingParams(max_tokens=1500, ignore_eos=True)  # seconds of steps: still running later


def engine(**overrides: Any) -> Any:
    overrides.setdefault("num_blocks", 400)
    overrides.setdefault("max_model_len", 2048)
    return make_engine(tiny_llama_config(max_position_embeddings=2048), seed=3, **overrides)


@pytest.fixture
async def service() -> AsyncIterator[EngineService]:
    svc = EngineService(engine(), asyncio.get_running_loop()).start()
    yield svc
    await svc.close()
    assert_engine_empty(svc.engine)


class Collector:
    def __init__(self) -> None:
        self.updates: list[RequestOutput] = []
        self.done = asyncio.Event()

    def __call__(self, update: RequestOutput) -> None:
        assert asyncio.get_running_loop()  # delivered on the event loop, not the engine thread
        assert not self.done.is_set(), "an update arrived after the last one"
        self.updates.append(update)
        if update.is_last:
            self.done.set()

    async def wait(self, timeout_s: float = 30.0) -> RequestOutput:
        await asyncio.wait_for(self.done.wait(), timeout_s)
        return self.updates[-1]

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """Every token delivered so far (each update carries only its new ones)."""
        return tuple(t for u in self.updates for t in u.token_ids)


async def test_a_submitted_request_streams_the_tokens_generate_would_give(
    service: EngineService,
) -> None:
    expected = engine().generate([PROMPT], GREEDY)[0]
    got = Collector()
    await service.submit("r1", PROMPT, GREEDY, got)
    last = await got.wait()
    assert last.finished and last.finish_reason == "length"
    assert list(got.output_token_ids) == expected
    # Only new tokens travel: one per step, never the history again.
    assert [len(u.token_ids) for u in got.updates] == [1] * 6


async def test_a_callback_that_raises_costs_the_other_requests_nothing(
    service: EngineService, caplog: pytest.LogCaptureFixture
) -> None:
    """A step's updates reach the loop together; one subscriber's exception is logged and the
    rest of the step's callbacks still run."""
    calls: list[RequestOutput] = []

    def broken(update: RequestOutput) -> None:
        calls.append(update)
        raise RuntimeError("subscriber bug")

    good = Collector()
    await asyncio.gather(
        service.submit("broken", PROMPT, GREEDY, broken),
        service.submit("good", PROMPT, GREEDY, good),
    )
    last = await good.wait()
    assert last.finished and len(good.output_token_ids) == 6
    assert len(calls) == 6 and calls[-1].finished  # every update was still offered to it
    assert "output callback failed request_id=broken" in caplog.text


async def test_an_invalid_request_raises_and_keeps_nothing(service: EngineService) -> None:
    with pytest.raises(InvalidRequestError):
        await service.submit("bad", [], GREEDY, Collector())
    counts = await service.counts()
    assert counts.num_requests == 0 and counts.num_free_blocks == counts.num_blocks


async def test_a_request_past_its_deadline_is_aborted_with_one_error_update(
    service: EngineService,
) -> None:
    got = Collector()
    await service.submit("late", PROMPT, LONG, got, deadline_monotonic=time.monotonic() + 0.2)
    last = await got.wait()
    assert last.error == "deadline" and not last.finished
    assert len(got.updates) > 1  # it ran until the deadline, then stopped
    assert (await service.counts()).num_requests == 0


async def test_a_reserved_request_runs_only_once_installed(service: EngineService) -> None:
    reservation = await service.reserve("r", PROMPT, GREEDY)
    assert reservation is not None and len(reservation.block_ids) == 6
    counts = await service.counts()
    assert counts.num_free_blocks == counts.num_blocks - 6
    got = Collector()
    await service.install("r", 42, got)
    last = await got.wait()
    assert last.finished and got.output_token_ids[0] == 42 and len(got.output_token_ids) == 6
    assert got.updates[0].token_ids == (42,)


async def test_an_abandoned_reservation_is_freed_by_abort(service: EngineService) -> None:
    assert await service.reserve("r", PROMPT, GREEDY) is not None
    assert await service.abort("r")
    assert not await service.abort("r")
    counts = await service.counts()
    assert counts.num_requests == 0 and counts.num_free_blocks == counts.num_blocks


async def test_a_prefill_retains_its_blocks_until_released(service: EngineService) -> None:
    result = await service.prefill("p", PROMPT, SamplingParams(max_tokens=1))
    assert len(result.block_ids) == 6
    retained = await service._call(lambda: service.engine.retained_block_ids("p"))
    assert list(result.block_ids) == retained  # read as it finished: the same blocks, in order
    assert result.first_token_id == engine().generate([PROMPT], SamplingParams(max_tokens=1))[0][0]
    counts = await service.counts()
    assert counts.num_retained == 1 and counts.num_free_blocks == counts.num_blocks - 6
    await service.release("p")
    await service.release("p")  # idempotent
    assert (await service.counts()).num_retained == 0


async def test_a_prefill_past_its_deadline_raises_and_retains_nothing(
    service: EngineService,
) -> None:
    with pytest.raises(DeadlineExceededError):
        await service.prefill("p", PROMPT, SamplingParams(max_tokens=1), deadline_monotonic=0.0)
    assert (await service.counts()).num_retained == 0


async def test_an_aborted_request_gets_no_more_updates(service: EngineService) -> None:
    """Aborted while it streams (it had updates, and a request beside it keeps getting them
    over the same time), it gets none after the abort."""
    got, beside = Collector(), Collector()
    await service.submit("r", PROMPT, LONG, got)
    await service.submit("beside", list(range(70, 90)), LONG, beside)
    deadline = asyncio.get_running_loop().time() + 30
    while not got.updates:
        assert asyncio.get_running_loop().time() < deadline, "the request never streamed"
        await asyncio.sleep(0.01)
    assert await service.abort("r")
    seen, beside_seen = len(got.updates), len(beside.updates)
    while len(beside.updates) < beside_seen + 3:  # the engine kept stepping meanwhile
        assert asyncio.get_running_loop().time() < deadline, "the engine stopped stepping"
        await asyncio.sleep(0.01)
    assert len(got.updates) == seen and not got.done.is_set()
    assert await service.abort("beside")


async def test_close_fails_what_is_left_and_the_engine_ends_empty() -> None:
    svc = EngineService(engine(), asyncio.get_running_loop()).start()
    got = Collector()
    await svc.submit("r", PROMPT, LONG, got)
    assert await svc.reserve("q", list(range(50, 60)), GREEDY) is not None
    await svc.close()
    assert (await got.wait()).error == "shutdown"
    assert_engine_empty(svc.engine)
    with pytest.raises(RuntimeError, match="stopped"):
        await svc.counts()


class KvMirror:
    """An `on_kv_changes` subscriber: the cached hashes, rebuilt from the changes delivered."""

    def __init__(self) -> None:
        self.cached: set[bytes] = set()
        self.num_batches = 0

    def __call__(self, changes: KvChanges) -> None:
        assert asyncio.get_running_loop()  # delivered on the event loop
        assert not changes.is_empty
        assert not set(changes.stored) & self.cached and set(changes.removed) <= self.cached
        self.cached.difference_update(changes.removed)
        self.cached.update(changes.stored)
        self.num_batches += 1


def prompt_hashes(svc: EngineService, prompt: list[int]) -> set[bytes]:
    e = svc.engine
    return set(block_hashes(prompt, e.config.block_size, root_hash(e.fingerprint.digest)))


async def test_kv_changes_reach_the_loop_before_the_first_token_and_mirror_the_cache() -> None:
    mirror = KvMirror()
    svc = EngineService(engine(num_blocks=12), asyncio.get_running_loop(), on_kv_changes=mirror)
    svc.start()
    expected = prompt_hashes(svc, PROMPT)
    seen_at_first_token: list[set[bytes]] = []

    got = Collector()

    def on_update(update: RequestOutput) -> None:
        if not got.updates:  # the first token
            seen_at_first_token.append(set(mirror.cached))
        got(update)

    await svc.submit("r1", PROMPT, GREEDY, on_update)
    await got.wait()
    assert seen_at_first_token == [expected]  # the 5 full prompt blocks, before the token
    # Another prompt needs 6 of the 11 blocks: it evicts some of r1's cached ones.
    other = list(range(40, 61))
    got = Collector()
    await svc.submit("r2", other, GREEDY, got)
    await got.wait()
    await svc.close()
    assert_engine_empty(svc.engine)
    assert mirror.cached == set(svc.engine.cached_block_hashes())
    assert prompt_hashes(svc, other) <= mirror.cached and not expected <= mirror.cached


async def test_an_installed_remote_prompt_is_reported_before_its_first_token() -> None:
    mirror = KvMirror()
    svc = EngineService(engine(), asyncio.get_running_loop(), on_kv_changes=mirror).start()
    assert await svc.reserve("r", PROMPT, GREEDY) is not None
    await svc.counts()  # one more engine loop iteration: reserving stores nothing
    assert mirror.cached == set()
    seen: list[set[bytes]] = []
    got = Collector()

    def on_update(update: RequestOutput) -> None:
        seen.append(set(mirror.cached))
        got(update)

    await svc.install("r", 42, on_update)
    await got.wait()
    assert seen[0] == prompt_hashes(svc, PROMPT)
    await svc.close()
    assert mirror.cached == set(svc.engine.cached_block_hashes())
    assert_engine_empty(svc.engine)


async def test_lower_tier_changes_follow_the_gpu_changes_of_the_same_iteration() -> None:
    """The engine's tiers land elsewhere: this engine's host tier is a stand-in that, once the
    prompt's blocks are cached, reports them written behind to host memory."""
    delivered: list[KvChanges] = []
    eng = engine()
    take_gpu = eng.take_kv_events
    written_behind: list[KvChanges] = []

    def take_kv_events() -> KvChanges:
        changes = take_gpu()
        if changes.stored:  # the write-behind of the same iteration
            written_behind.append(KvChanges(stored=changes.stored[:2], tier="host"))
        return changes

    def take_tier_events() -> list[KvChanges]:
        out = [*written_behind, KvChanges(tier="disk")]  # an empty batch is never delivered
        written_behind.clear()
        return out

    eng.take_kv_events, eng.take_tier_events = take_kv_events, take_tier_events
    svc = EngineService(eng, asyncio.get_running_loop(), on_kv_changes=delivered.append).start()
    got = Collector()
    await svc.submit("r", PROMPT, GREEDY, got)
    await got.wait()
    await svc.close()
    assert_engine_empty(svc.engine)
    # Each host batch right after the GPU batch of its iteration (the prompt's blocks, then the
    # block its decode filled).
    assert [c.tier for c in delivered] == ["gpu", "host"] * 2
    assert set(delivered[0].stored) == prompt_hashes(svc, PROMPT)
    for gpu, host in zip(delivered[::2], delivered[1::2], strict=True):
        assert host.stored == gpu.stored[:2]


class Gate:
    """A stand-in for a step's CUDA event, on the CPU (where a step has no event): the waiter
    thread's `synchronize` blocks until the test opens the gate, as it would while the device
    runs a long step."""

    def __init__(self, fail: bool = False) -> None:
        self.opened = threading.Event()
        self.waiting = threading.Event()
        self.fail = fail

    def synchronize(self) -> None:
        self.waiting.set()
        self.opened.wait(30)
        if self.fail:
            raise RuntimeError("an illegal memory access was encountered (stand-in)")


def gated(svc: EngineService, gate: Gate) -> None:
    """Every step of `svc`'s engine now waits on `gate`, through the service's own waiter."""
    serve_while_waiting = svc.engine.pipeline.step_waiter
    svc.engine.pipeline.step_waiter = lambda done: serve_while_waiting(gate)


async def test_commands_run_while_a_step_runs_on_the_device() -> None:
    """A reservation, an install, a new request and an abort do not wait for the step in
    flight to end; the held step's outputs are then applied as if they had run after it."""
    svc = EngineService(engine(), asyncio.get_running_loop()).start()
    gate = Gate()
    gated(svc, gate)
    try:
        expected = engine().generate([PROMPT], GREEDY)[0]
        first, aborted = Collector(), Collector()
        await svc.submit("first", PROMPT, GREEDY, first)
        await svc.submit("aborted", PROMPT, LONG, aborted)
        assert await asyncio.to_thread(gate.waiting.wait, 30)  # a step is "on the device"
        for command in (
            svc.reserve("remote", PROMPT, GREEDY),
            svc.counts(),
            svc.submit("later", PROMPT, GREEDY, Collector()),
            svc.abort("aborted"),
        ):
            await asyncio.wait_for(command, 5)  # answered with the gate still closed
        assert not first.updates and not gate.opened.is_set()
        installed = Collector()
        await asyncio.wait_for(svc.install("remote", 7, installed), 5)
        assert installed.output_token_ids == (7,)
        gate.opened.set()
        assert (await first.wait()).finished and list(first.output_token_ids) == expected
        assert (await installed.wait()).finished
        assert not aborted.updates  # aborted before the held step's outputs were applied
    finally:
        gate.opened.set()
        await svc.close()
    assert_engine_empty(svc.engine)


async def test_a_step_whose_device_wait_fails_fails_its_requests_not_the_service() -> None:
    svc = EngineService(engine(), asyncio.get_running_loop()).start()
    serve_while_waiting = svc.engine.pipeline.step_waiter
    gate = Gate(fail=True)
    gated(svc, gate)
    gate.opened.set()
    try:
        failed = Collector()
        await svc.submit("r1", PROMPT, GREEDY, failed)
        assert (await failed.wait()).error == "engine_error"
        svc.engine.pipeline.step_waiter = serve_while_waiting  # the device is well again
        ok = Collector()
        await svc.submit("r2", PROMPT, GREEDY, ok)
        assert (await ok.wait()).finished
    finally:
        await svc.close()
    assert_engine_empty(svc.engine)
