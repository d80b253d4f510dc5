"""How soon a request whose prefix loads from the host tier joins a step: the real scheduler and
tiers, scheduling one step ahead as the engine does on a GPU, over a copier that runs its copies
at once on the CPU but reports a load done when a GPU's would be (`GpuTimedCopier`, whose
docstring gives the timing model)."""

from __future__ import annotations

from kvrail.worker.engine.kv_tiers.copier import Copier
from kvrail.worker.engine.kv_tiers.tiers import KvTiers
from kvrail.worker.engine.request import Request, RequestStatus
from kvrail.worker.engine.scheduler import Scheduler
from kvrail.worker.engine.scheduler_output import SchedulerOutput
from kvrail.worker.testing import (
    GpuTimedCopier,
    assert_engine_empty,
    attach_gpu_timed_tiers,
    make_request,
    make_scheduler,
)

PREFIX = list(range(500, 520))  # 5 blocks of 4 tokens


class AheadLoop:
    """Drives the scheduler as `StepPipeline` does with async scheduling: each iteration
    schedules the next step while the previous one runs, then applies that one's tokens."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.in_flight: SchedulerOutput | None = None
        self.first_step: dict[str, int] = {}
        self.admitted: dict[str, int] = {}  # loading request -> epoch its load started

    def step(self) -> None:
        scheduler = self.scheduler
        out = scheduler.schedule_ahead() if self.in_flight else scheduler.schedule()
        assert out is not None, "these workloads never preempt"
        epoch = scheduler.kv_cache_manager.block_pool.epoch
        for item in out.decodes + out.prefills:
            self.first_step.setdefault(item.request.request_id, epoch)
        for request_id in scheduler.tier_loads.loading if scheduler.tier_loads else ():
            self.admitted.setdefault(request_id, epoch)
        if self.in_flight is not None:
            items = self.in_flight.decodes + self.in_flight.prefills
            scheduler.update_from_output(
                self.in_flight, {i.request.request_id: 50 for i in items if i.samples}
            )
        self.in_flight = None if out.is_empty else out

    def run(self, *requests: Request) -> None:
        """Until `requests` have finished (and nothing else is left in flight)."""
        while any(not r.is_finished for r in requests) or self.in_flight is not None:
            self.step()


def _tiered(num_blocks: int) -> tuple[Scheduler, KvTiers, GpuTimedCopier]:
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=64)
    copier = attach_gpu_timed_tiers(scheduler, host_blocks=40)
    assert scheduler.tier_loads is not None
    return scheduler, scheduler.tier_loads.tiers, copier


def _write_prefix_behind(scheduler: Scheduler, loop: AheadLoop) -> None:
    """Serve PREFIX once, so it is written behind, then drop it from the GPU's prefix cache."""
    first = make_request(prompt_token_ids=PREFIX, max_tokens=2)
    scheduler.add_request(first)
    loop.run(first)
    loop.step()  # the write-behind's copies are taken
    scheduler.kv_cache_manager.block_pool.reset_prefix_cache()


def test_a_load_into_long_free_blocks_joins_the_step_after_the_one_in_flight() -> None:
    scheduler, tiers, copier = _tiered(num_blocks=40)
    loop = AheadLoop(scheduler)
    _write_prefix_behind(scheduler, loop)
    decoding = make_request(num_prompt_tokens=8, max_tokens=30)  # steps keep running
    scheduler.add_request(decoding)
    for _ in range(3):
        loop.step()
    again = make_request(prompt_token_ids=[*PREFIX, 7, 8, 9, 10], max_tokens=2)
    scheduler.add_request(again)
    loop.run(again, decoding)
    epoch, released, mark = copier.loads[-1]
    assert released <= epoch - 2, "blocks free since before the step in flight was scheduled"
    assert mark == epoch - 1, "its copies run beside the step in flight"
    assert loop.admitted[again.request_id] == epoch
    assert loop.first_step[again.request_id] == epoch + 1  # not epoch + 2
    assert again.num_cached_tokens == len(PREFIX)
    while tiers.busy:
        loop.step()
    assert_engine_empty(scheduler)


def test_a_load_into_blocks_released_under_the_step_in_flight_waits_for_that_step() -> None:
    # 9 blocks: `again` (6) waits for `holder` (7) to finish, and gets the blocks it releases.
    scheduler, tiers, copier = _tiered(num_blocks=10)
    loop = AheadLoop(scheduler)
    _write_prefix_behind(scheduler, loop)
    holder = make_request(num_prompt_tokens=24, max_tokens=5)  # 7 blocks at the end
    scheduler.add_request(holder)
    loop.step()
    again = make_request(prompt_token_ids=[*PREFIX, 7, 8, 9, 10], max_tokens=2)
    scheduler.add_request(again)
    loop.run(holder, again)
    epoch, released, mark = copier.loads[-1]
    assert released == epoch - 1, "some of its blocks were released after the step in flight"
    assert mark == epoch, "so it waits for that step"
    assert loop.first_step[again.request_id] == epoch + 2
    assert again.status is RequestStatus.FINISHED_LENGTH
    assert again.num_cached_tokens == len(PREFIX)
    for started, latest_release, waited_for in copier.loads:
        assert waited_for > latest_release, "a load never overtakes work on a released block"
        assert waited_for <= started
    while tiers.busy:
        loop.step()
    assert_engine_empty(scheduler)


def test_a_load_waits_for_the_first_mark_kept_from_the_one_asked_for_else_for_everything() -> None:
    """The choice `Copier.load` makes on a GPU, made here over stand-ins for its CUDA events."""
    scheduler, _tiers, copier = _tiered(num_blocks=8)
    earlier, current = object(), object()
    Copier.mark(copier, 3)  # a CPU device records nothing
    assert Copier._mark_after(copier, 3) is None
    copier._marks = {4: earlier, 5: current}  # type: ignore[dict-item]
    assert Copier._mark_after(copier, 2) is earlier  # released long ago: before the step in flight
    assert Copier._mark_after(copier, 4) is earlier
    assert Copier._mark_after(copier, 5) is current  # released under the step in flight
    assert Copier._mark_after(copier, 6) is None  # released in this schedule: after all queued
    assert Copier._mark_after(copier, None) is None
    assert_engine_empty(scheduler)
