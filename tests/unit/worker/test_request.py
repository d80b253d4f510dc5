"""Request statuses and token bookkeeping (SamplingParams: tests/unit/kvrail/test_sampling.py)."""

from __future__ import annotations

from kvrail.worker.engine.request import RequestStatus


def test_only_finished_statuses_have_a_finish_reason_and_a_failed_one_has_none() -> None:
    finished = {s for s in RequestStatus if s.is_finished}
    failed = {RequestStatus.FINISHED_ERROR}  # its output carries the error instead
    assert finished - failed == {s for s in RequestStatus if s.finish_reason is not None}
    assert failed <= finished
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"


def test_token_ids_between_equals_slicing_all_token_ids() -> None:
    from kvrail.worker.testing import make_request

    request = make_request(5)
    request.output_token_ids.extend([1, 2, 3])
    everything = request.all_token_ids
    for start in range(9):
        for end in range(start, 9):
            assert request.token_ids_between(start, end) == everything[start:end]
