"""Scheduler: token budget, chunked prefill, decode priority, preemption, admission, abort,
remote KV. Every test ends with assert_engine_empty."""

from __future__ import annotations

from typing import Any

import pytest

from kvrail.errors import InvalidRequestError
from kvrail.worker.engine.request import RequestStatus
from kvrail.worker.testing import (
    assert_engine_empty,
    make_request,
    make_scheduler,
    run_scheduler_to_completion,
)


def test_every_request_gets_max_tokens_within_the_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    requests = [make_request(n, max_tokens=m) for n, m in [(3, 5), (17, 2), (40, 7), (1, 1)]]
    for request in requests:
        scheduler.add_request(request)
    run_scheduler_to_completion(scheduler)
    assert [r.num_output_tokens for r in requests] == [5, 2, 7, 1]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert_engine_empty(scheduler)


def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    request = make_request(50, max_tokens=2)
    scheduler.add_request(request)
    outputs = run_scheduler_to_completion(scheduler)
    fed = [o.num_batched_tokens for o in outputs]
    assert fed == [16, 16, 16, 2, 1]
    assert [s.samples for o in outputs for s in o.decodes + o.prefills] == [
        False,
        False,
        False,
        True,
        True,
    ]
    assert_engine_empty(scheduler)


def test_decodes_are_scheduled_before_a_new_prefill_takes_the_rest_of_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    first = make_request(4, max_tokens=5)
    scheduler.add_request(first)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {first.request_id: 50})
    second = make_request(30, max_tokens=1)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert [s.request for s in out.decodes] == [first]
    assert [(s.request, s.num_new_tokens) for s in out.prefills] == [(second, 7)]
    scheduler.update_from_output(out, {first.request_id: 50})
    run_scheduler_to_completion(scheduler)
    assert_engine_empty(scheduler)


def test_admission_reserves_blocks_for_the_whole_prompt_before_running() -> None:
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=4)  # 5 usable 4-token blocks
    first, second = make_request(12, max_tokens=2), make_request(12, max_tokens=2)
    scheduler.add_request(first)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert [s.request for s in out.prefills] == [first]
    assert len(scheduler.kv_cache_manager.get_block_ids(first.request_id)) == 3
    assert second.status is RequestStatus.WAITING
    scheduler.update_from_output(out, {})
    run_scheduler_to_completion(scheduler)
    assert second.num_output_tokens == 2
    assert_engine_empty(scheduler)


def test_out_of_blocks_preempts_the_latest_request_and_recomputes_it() -> None:
    scheduler = make_scheduler(num_blocks=7, max_num_batched_tokens=64)  # 6 usable blocks
    early, late = make_request(8, max_tokens=12), make_request(8, max_tokens=12)
    scheduler.add_request(early)
    scheduler.add_request(late)
    outputs = run_scheduler_to_completion(scheduler, next_token=77)
    preempted = [i for o in outputs for i in o.preempted_ids]
    assert preempted and set(preempted) == {late.request_id}
    assert early.num_preemptions == 0 and late.num_preemptions >= 1
    assert late.output_token_ids == [77] * 12 and early.output_token_ids == [77] * 12
    assert_engine_empty(scheduler)


@pytest.mark.parametrize("stage", ["waiting", "mid-prefill", "decoding", "remote"])
def test_abort_frees_every_block_in_any_state(stage: str) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request(20, max_tokens=10)
    if stage == "remote":
        assert scheduler.reserve_remote(request) is not None
    else:
        scheduler.add_request(request)
    steps = {"waiting": 0, "mid-prefill": 1, "decoding": 4, "remote": 0}[stage]
    for _ in range(steps):
        out = scheduler.schedule()
        scheduler.update_from_output(out, {request.request_id: 60})
    assert scheduler.abort(request.request_id)
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert not scheduler.abort(request.request_id)
    assert_engine_empty(scheduler)


def test_remote_request_is_invisible_until_installed_then_decodes() -> None:
    scheduler = make_scheduler()
    request = make_request(10, max_tokens=3)
    reservation = scheduler.reserve_remote(request)
    assert reservation is not None and len(reservation.block_ids) == 3
    assert reservation.num_cached_tokens == 0
    assert scheduler.schedule().is_empty
    scheduler.install_remote(request.request_id, 55)
    assert request.output_token_ids == [55]
    run_scheduler_to_completion(scheduler)
    assert request.num_output_tokens == 3
    # Its prompt blocks were cached on install: a second reservation reuses them.
    again = make_request(prompt_token_ids=request.prompt_token_ids, max_tokens=3)
    second = scheduler.reserve_remote(again)
    assert second is not None and second.num_cached_tokens == 8
    scheduler.abort(again.request_id)
    assert_engine_empty(scheduler)


def test_remote_reservation_that_does_not_fit_returns_none_with_no_effect() -> None:
    scheduler = make_scheduler(num_blocks=4)
    assert scheduler.reserve_remote(make_request(8, max_tokens=1)) is not None
    late = make_request(8, max_tokens=1)
    assert scheduler.reserve_remote(late) is None
    assert late.request_id not in scheduler.requests
    for request_id in list(scheduler.requests):
        scheduler.abort(request_id)
    assert_engine_empty(scheduler)


def test_install_of_an_unreserved_request_raises() -> None:
    scheduler = make_scheduler()
    with pytest.raises(KeyError):
        scheduler.install_remote("nobody", 3)


BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("empty prompt", {"prompt_token_ids": []}, "empty"),
    ("prompt longer than the model limit", {"num_prompt_tokens": 1025}, "model limit"),
    (
        "prompt plus max_tokens over the limit",
        {"num_prompt_tokens": 1000, "max_tokens": 30},
        "exceed",
    ),
    ("request larger than the whole pool", {"num_prompt_tokens": 300}, "KV pool"),
]


@pytest.mark.parametrize(
    ("case", "kwargs", "match"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_requests_are_rejected_with_a_clear_error_and_leave_nothing(
    case: str, kwargs: dict[str, Any], match: str
) -> None:
    scheduler = make_scheduler()
    with pytest.raises(InvalidRequestError, match=match):
        scheduler.add_request(make_request(**kwargs))
    assert_engine_empty(scheduler)


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request(4, request_id="same"))
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add_request(make_request(4, request_id="same"))
    scheduler.abort("same")
    assert_engine_empty(scheduler)


def test_stop_conditions_finish_requests_with_the_right_reason() -> None:
    """EOS, ignore_eos, stop token ids and min_tokens (stop strings are the router's: its
    detokenizer finds them, tests/unit/router/test_text.py)."""
    scheduler = make_scheduler()
    cases = {
        "eos": make_request(4, max_tokens=5, ignore_eos=False),
        "ignored eos": make_request(4, max_tokens=3),
        "stop id": make_request(4, max_tokens=5, stop_token_ids=(2,)),
        "eos after min_tokens": make_request(4, max_tokens=5, min_tokens=3, ignore_eos=False),
    }
    for request in cases.values():
        scheduler.add_request(request)
    run_scheduler_to_completion(scheduler, next_token=2)
    assert cases["eos"].output_token_ids == [2] and cases["eos"].stop_reason == 2
    assert cases["ignored eos"].status is RequestStatus.FINISHED_LENGTH
    assert cases["stop id"].status is RequestStatus.FINISHED_STOPPED
    late = cases["eos after min_tokens"]
    assert late.output_token_ids == [2, 2, 2] and late.status is RequestStatus.FINISHED_STOPPED
    assert_engine_empty(scheduler)


def test_a_step_that_decodes_takes_no_more_prefill_than_the_mixed_cap() -> None:
    """A long prompt arriving while others decode is chunked to the cap, so their next token
    never waits on one long step; alone, it takes the full budget."""
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_mixed_prefill_tokens=8)
    decoding = make_request(4, max_tokens=20)
    scheduler.add_request(decoding)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {decoding.request_id: 77})
    long = make_request(40, max_tokens=2)
    scheduler.add_request(long)
    seen = []
    while not long.is_finished:
        out = scheduler.schedule()
        seen.append(sum(item.num_new_tokens for item in out.prefills))
        sampled = {item.request.request_id: 77 for item in out.decodes + out.prefills
                   if item.samples}  # fmt: skip
        scheduler.update_from_output(out, sampled)
    assert seen[:5] == [8, 8, 8, 8, 8]  # 40 prompt tokens in chunks of 8 beside the decode
    scheduler.abort(decoding.request_id)
    alone = make_request(40, max_tokens=1)
    scheduler.add_request(alone)
    out = scheduler.schedule()
    assert sum(item.num_new_tokens for item in out.prefills) == 40  # nothing decodes: no cap
    scheduler.update_from_output(out, {alone.request_id: 77})
    assert_engine_empty(scheduler)
