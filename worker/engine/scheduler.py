"""Iteration-level continuous batching under a per-step token budget.

Each `schedule()` call builds one step. There are no prefill or decode phases: a request simply
needs `num_tokens - num_computed_tokens` more tokens computed. The order is:

1. running requests that decode (one token each) - decode priority;
2. running requests still in (chunked) prefill, each getting what is left of the budget;
3. waiting requests, admitted in arrival order only if their blocks for the whole prompt (and
   their prefix hits) can be reserved first. Admission stops at the first that does not fit, and
   is skipped in a step that had to preempt.

When a running request needs a block and the pool is empty, the latest-arrived running request
not yet scheduled in this step is preempted by recompute: its blocks are freed, its tokens kept,
and it goes back to the head of the waiting queue (possibly the request itself).

Scheduling ahead (`schedule_ahead`): while a step runs on the device, the next one can be
scheduled before its sampled tokens are known. A request whose last step samples a token still
on the device (`Request.num_in_flight`) decodes that token next, fed from the device
(`ScheduledRequest.token_on_device`); it is not scheduled ahead when that token may be its last
(max_tokens reached) or when it retains its blocks. A request that stopped on the in-flight token
(EOS, a stop token id, a complete grammar) computes one token more, which is discarded. A request
with a grammar is scheduled ahead like any other: its mask, which needs the token in flight, is
filled once that token is known, while the step's forward runs (`step_pipeline`). Scheduling
ahead never preempts: when a request's blocks run short it returns None, and the caller resolves
the running step first.

KV tiers (`attach_tiers`): prefix hits past the GPU's load from host memory or disk before the
request runs (`tier_loads` says how; such a request is admitted but waits for its load unless it
is done at once).

Remote KV: `reserve_remote` reserves all prompt blocks now; the request is invisible to
`schedule()` until `install_remote` marks its KV fully written. A finished request with
`retain_blocks` keeps its blocks until `release`. `abort` releases everything, in any state.
After every public call the block invariants hold (see `check_invariants`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from kvrail.errors import InvalidRequestError
from kvrail.worker.engine.config import EngineConfig
from kvrail.worker.engine.grammar import Grammars
from kvrail.worker.engine.kv_cache_manager import KVCacheManager
from kvrail.worker.engine.kv_tiers.tiers import KvTiers
from kvrail.worker.engine.request import Request, RequestStatus
from kvrail.worker.engine.scheduler_output import (
    RemoteReservation,
    ScheduledRequest,
    SchedulerOutput,
)
from kvrail.worker.engine.stop import StopChecker
from kvrail.worker.engine.tier_loads import TierLoads

logger = logging.getLogger(__name__)

_NOT_RETAINED = frozenset({RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})
"""Finished states in which even a `retain_blocks` request frees its blocks at once."""


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        hash_root: bytes,
        stop_checker: StopChecker,
        on_release: Callable[[list[int]], None] | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        """`on_release`: see `BlockPool` (zeroing released blocks). `grammars`: what enforces
        `SamplingParams.grammar` (None: a request with a grammar is refused)."""
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks, config.block_size, hash_root, config.enable_prefix_caching,
            on_release,
        )  # fmt: skip
        self.stop_checker = stop_checker
        self.grammars = grammars if grammars is not None else Grammars(None)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.retained: dict[str, Request] = {}
        self.tier_loads: TierLoads | None = None
        self._num_arrived = 0

    def attach_tiers(self, tiers: KvTiers) -> None:
        """Serve prefix hits from `tiers` and write every newly cached block behind to them."""
        self.tier_loads = TierLoads(tiers, self.kv_cache_manager)

    def validate(self, request: Request) -> None:
        """Raise InvalidRequestError unless the request could ever complete here."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty")
        limit = self.config.max_model_len
        if num_prompt > limit:
            raise InvalidRequestError(f"prompt has {num_prompt} tokens, the model limit is {limit}")
        total = num_prompt + request.sampling_params.max_tokens
        if total > limit:
            raise InvalidRequestError(
                f"prompt ({num_prompt}) + max_tokens ({request.sampling_params.max_tokens}) "
                f"tokens exceed the model limit of {limit}"
            )
        if not self.kv_cache_manager.can_ever_fit(total):
            raise InvalidRequestError(
                f"request needs {total} tokens of KV, more than the whole KV pool holds"
            )
        if request.request_id in self.requests or request.request_id in self.retained:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.grammars.check(request.sampling_params.grammar)

    def add_request(self, request: Request) -> None:
        """Queue a validated request for admission (raises InvalidRequestError first if bad)."""
        self.validate(request)
        request.arrival_index = self._num_arrived
        self._num_arrived += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve_remote(self, request: Request) -> RemoteReservation | None:
        """Reserve every prompt block for a request whose KV arrives from elsewhere, or return
        None with no effect. The request is never scheduled until `install_remote`."""
        self.validate(request)
        manager = self.kv_cache_manager
        hits = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, request.num_prompt_tokens, hits) is None:
            return None
        request.arrival_index = self._num_arrived
        self._num_arrived += 1
        request.num_cached_tokens = len(hits) * self.config.block_size
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        block_ids = manager.get_block_ids(request.request_id)
        num_lower = self.tier_loads.hits(request, len(hits)) if self.tier_loads else 0
        return RemoteReservation(
            request.request_id, block_ids, request.num_cached_tokens,
            num_lower_tier_tokens=num_lower * self.config.block_size,
        )  # fmt: skip

    def install_remote(self, request_id: str, first_token_id: int) -> Request:
        """Make a reserved request runnable: its whole prompt KV is written and `first_token_id`
        was sampled from it. Its full prompt blocks join the prefix cache only now."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        if self.tier_loads is not None:
            self.tier_loads.offload_new_blocks()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._append_token(request, first_token_id)
        return request

    def abort(self, request_id: str) -> bool:
        """Finish a request as aborted and free all its blocks. False if unknown or finished."""
        if request_id in self.retained:
            self.release(request_id)
            return True
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def release(self, request_id: str) -> None:
        """Free the blocks a finished `retain_blocks` request still holds."""
        request = self.retained.pop(request_id, None)
        if request is None:
            raise KeyError(f"request {request_id!r} holds no retained blocks")
        self.kv_cache_manager.free(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        """The next step, with every earlier step's tokens known (none in flight)."""
        out = self._schedule(ahead=False)
        assert out is not None, "only scheduling ahead gives up"
        return out

    def schedule_ahead(self) -> SchedulerOutput | None:
        """The next step while the previous one is still running (its sampled tokens unknown),
        or None when it would have to preempt: resolve the running step, then `schedule()`."""
        return self._schedule(ahead=True)

    def _schedule(self, *, ahead: bool) -> SchedulerOutput | None:
        if self.tier_loads is not None:
            self.tier_loads.begin_schedule()
            self.running.extend(self.tier_loads.take_finished())
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for request in self.running:
            if request.num_in_flight:
                assert ahead and request.num_in_flight == 1, "one step in flight at most"
                params = request.sampling_params
                last = request.num_output_tokens + 1 >= params.max_tokens
                if last or request.retain_blocks:
                    continue  # it may finish with the token in flight: wait for it
                if params.has_penalties:
                    continue  # its penalties need the token in flight: wait for it
            num_pending = request.num_tokens + request.num_in_flight - request.num_computed_tokens
            if num_pending == 1:
                decoding.append(request)
            elif num_pending > 1:
                prefilling.append(request)
        for request in decoding + prefilling:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_pending = request.num_tokens + request.num_in_flight - request.num_computed_tokens
            limit = budget if num_pending == 1 else self._prefill_room(out, budget)
            if limit == 0:
                break
            num_new = min(num_pending, limit)
            if ahead:
                slots = request.num_computed_tokens + num_new
                if self.kv_cache_manager.allocate_slots(request, slots) is None:
                    return None  # nothing committed yet: blocks taken stay with their requests
            elif not self._allocate_or_preempt(request, num_new, scheduled, out):
                continue
            self._emit(out, request, num_new)
            scheduled.add(request.request_id)
            budget -= num_new
        if not out.preempted_ids:
            self._admit(out, self._prefill_room(out, budget))
        for item in out.decodes + out.prefills:
            item.request.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens
            if item.samples:
                item.request.num_in_flight += 1
        return out

    def _prefill_room(self, out: SchedulerOutput, budget: int) -> int:
        """Prefill tokens this step may still take: the budget, and in a step that also decodes
        at most `max_num_mixed_prefill_tokens` of prefill in all (when set)."""
        cap = self.config.max_num_mixed_prefill_tokens
        if not cap or not out.decodes:
            return budget
        used = sum(item.num_new_tokens for item in out.prefills)
        return max(0, min(budget, cap - used))

    def _allocate_or_preempt(
        self, request: Request, num_new: int, scheduled: set[str], out: SchedulerOutput
    ) -> bool:
        manager = self.kv_cache_manager
        while manager.allocate_slots(request, request.num_computed_tokens + num_new) is None:
            victims = [r for r in self.running if r.request_id not in scheduled]
            victim = max(victims, key=lambda r: r.arrival_index)
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        manager = self.kv_cache_manager
        while self.waiting and budget > 0 and self._num_admitted < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = manager.get_computed_blocks(request)
            num_hit_tokens = len(hits) * self.config.block_size
            num_lower = self.tier_loads.hits(request, len(hits)) if self.tier_loads else 0
            num_new = request.num_tokens - num_hit_tokens - num_lower * self.config.block_size
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            # Reserve blocks for every known token before running any of them.
            new_blocks = manager.allocate_slots(request, request.num_tokens, hits)
            if new_blocks is None:
                break
            self.waiting.popleft()
            loads = self.tier_loads
            if num_lower and loads and loads.start(request, len(hits), new_blocks[:num_lower]):
                if not loads.take(request):
                    continue  # it joins a step once its load is done
            else:
                request.num_computed_tokens = num_hit_tokens
                request.num_cached_tokens = max(request.num_cached_tokens, num_hit_tokens)
                request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            self._emit(out, request, num_new)
            budget -= num_new

    @property
    def _num_admitted(self) -> int:
        return len(self.running) + (len(self.tier_loads.loading) if self.tier_loads else 0)

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        start = request.num_computed_tokens
        on_device = request.num_in_flight > 0  # a decode of the token still on the device
        token_ids = [0] if on_device else request.token_ids_between(start, start + num_new)
        samples = start + num_new == request.num_tokens + request.num_in_flight
        item = ScheduledRequest(request, start, token_ids, block_ids, samples, on_device)
        (out.decodes if num_new == 1 else out.prefills).append(item)
        if samples and request.sampling_params.grammar is not None:
            out.has_grammar = True
        if (
            request.sampling_params.prompt_logprobs is not None
            and start < request.num_prompt_tokens - 1
        ):
            out.scores_prompt = True  # a prompt position to score in this chunk

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.info(
            "request preempted request_id=%s tokens=%d", request.request_id, request.num_tokens
        )

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Once a step has run: publish the blocks it filled, append each sampled token, and
        finish those that stopped. Returns the requests that got a token. (`schedule` already
        counted the step's tokens as computed; a step scheduled ahead may have counted more.)"""
        advanced = []
        for item in out.decodes + out.prefills:
            request = item.request
            if item.samples:
                request.num_in_flight -= 1
            if request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted since it was scheduled: its token is dropped
            computed = item.num_computed_tokens + item.num_new_tokens
            self.kv_cache_manager.cache_blocks(request, computed)
            if item.samples:
                self._append_token(request, sampled_token_ids[request.request_id])
                advanced.append(request)
        if self.tier_loads is not None:
            self.tier_loads.offload_new_blocks()
        return advanced

    def _append_token(self, request: Request, token_id: int) -> None:
        """The one way an output token joins a request, sampled by a step here or installed from
        a remote prefill: per-request sampler state advances here (see `sampler`), a grammar's
        matcher included (`Grammars.advance`: it may end or fail the request)."""
        request.output_token_ids.append(token_id)
        status = self.stop_checker.check(request)
        if request.sampling_params.grammar is not None:
            status = self.grammars.advance(request, status)
        if status is not None:
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.grammar_matcher = None  # a retained request keeps its record, not this
        if request.retain_blocks and status not in _NOT_RETAINED:
            self.retained[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        if request in self.running:
            self.running.remove(request)
        elif self.tier_loads is not None and self.tier_loads.forget(request.request_id):
            pass  # its load still runs into the blocks: the tiers hold them until it is done
        elif request in self.waiting:
            self.waiting.remove(request)
        del self.requests[request.request_id]
        request.status = status
        logger.info(
            "request finished request_id=%s reason=%s prompt_tokens=%d output_tokens=%d",
            request.request_id,
            status.finish_reason or request.error,
            request.num_prompt_tokens,
            request.num_output_tokens,
        )

    def check_invariants(self) -> None:
        """Block invariants plus: every held block table belongs to a live request, and no
        waiting request holds blocks."""
        self.kv_cache_manager.check_invariants()
        for request_id in self.kv_cache_manager.req_to_blocks:
            live = request_id in self.requests or request_id in self.retained
            assert live, f"finished request {request_id} holds blocks"
        for request in self.waiting:
            assert request.request_id not in self.kv_cache_manager.req_to_blocks
        for request in self.tier_loads.loading.values() if self.tier_loads else ():
            assert request.status is RequestStatus.WAITING_FOR_TIER_KV
