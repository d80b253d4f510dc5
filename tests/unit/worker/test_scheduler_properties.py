"""Random workloads through the scheduler (Hypothesis): shared prefixes, chunked prefill,
preemption, aborts and remote reservations, with and without a host KV tier (loads, aborts
while loading, write-behind pins). After every step the block invariants hold and the
token budget is respected; at the end every surviving request has exactly max_tokens tokens and
the engine is empty."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvrail.worker.engine.request import RequestStatus
from kvrail.worker.testing import (
    assert_engine_empty,
    attach_gpu_timed_tiers,
    make_request,
    make_scheduler,
)

REQUEST = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.integers(1, 30),  # prompt length
    st.integers(1, 18),  # max_tokens (prompt + max_tokens <= 48 = max_model_len)
    st.sampled_from(["local", "remote", "abort-early", "abort-late"]),
)


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(REQUEST, min_size=1, max_size=8),
    num_blocks=st.integers(13, 24),  # 13: the largest request (48 tokens) just fits
    budget=st.integers(1, 24),
    arrival_gap=st.integers(0, 2),
    host_blocks=st.sampled_from([0, 3, 40]),  # no tier, one that evicts, one that keeps all
)
def test_random_workloads_finish_with_every_block_returned(
    requests: list[tuple[int, int, int, str]],
    num_blocks: int,
    budget: int,
    arrival_gap: int,
    host_blocks: int,
) -> None:
    scheduler = make_scheduler(
        num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, max_model_len=48
    )
    tiers = copier = None
    if host_blocks:  # loads done when a GPU's would be: requests wait for them, or abort
        copier = attach_gpu_timed_tiers(scheduler, host_blocks)
        tiers = scheduler.tier_loads.tiers if scheduler.tier_loads else None
    prefixes = [list(range(100 * p + 10, 100 * p + 40)) for p in range(3)]
    pending = [
        (make_request(prompt_token_ids=prefixes[p][:n], max_tokens=m), kind)
        for p, n, m, kind in requests
    ]
    remote_waiting: list[str] = []
    admitted = []
    step = 0
    while pending or scheduler.requests:
        step += 1
        assert step < 2000, "no progress"
        if pending and step % (arrival_gap + 1) == 0:
            request, kind = pending.pop(0)
            if kind == "remote":
                if scheduler.reserve_remote(request) is None:
                    pending.append((request, kind))  # no capacity now: retry later
                else:
                    remote_waiting.append(request.request_id)
                    admitted.append((request, kind))
            else:
                scheduler.add_request(request)
                admitted.append((request, kind))
        if remote_waiting and step % 3 == 0:
            scheduler.install_remote(remote_waiting.pop(0), 70)
        for request, kind in admitted:
            late = kind == "abort-late" and request.num_output_tokens >= 2
            if (kind == "abort-early" or late) and not request.is_finished:
                scheduler.abort(request.request_id)
        out = scheduler.schedule()
        if out.preempted_ids:
            event("a step preempted")
        if any(r.status is RequestStatus.WAITING_FOR_TIER_KV for r in scheduler.requests.values()):
            event("a request waited for its load")
        if tiers is not None and tiers.stats().loads["host"]:
            event("a request loaded from the host tier")
        if any(s.num_computed_tokens > 0 for s in out.prefills):
            event("a prefill continued after computed tokens")
        assert out.num_batched_tokens <= budget
        scheduler.check_invariants()
        sampled = {s.request.request_id: 50 for s in out.decodes + out.prefills}
        scheduler.update_from_output(out, sampled)
        scheduler.check_invariants()
    while tiers is not None and tiers.busy:  # write-behind still pins its last blocks
        scheduler.schedule()
    if tiers is not None and tiers.host.num_resident:
        event("blocks written behind to the host tier")
    for _started, latest_release, waited_for in copier.loads if copier else ():
        assert waited_for > latest_release, "a load never overtakes work on a released block"
    for request, kind in admitted:
        if kind.startswith("abort"):
            assert request.status in {RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_LENGTH}
        else:
            assert request.status is RequestStatus.FINISHED_LENGTH
            assert request.num_output_tokens == request.sampling_params.max_tokens
    assert_engine_empty(scheduler)
