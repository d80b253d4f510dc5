"""Which decode worker gets a request (pure: candidates in, decision out).

`kv-aware` (the default) minimises, in units of prompt blocks,

    cost = (num_prompt_blocks - matched_blocks)                      blocks to prefill
         + load_weight_blocks * max(num_running + num_waiting, in_flight)
         + kv_utilization_weight_blocks * kv_utilization

Why these terms and weights:
- Blocks to prefill: the work a cached prefix saves, and what time to first token grows with.
- Load: `num_running`/`num_waiting` are the worker's own counts but reach us through etcd about a
  second late; `in_flight` is this router's requests on the worker, known at once. With
  `in_flight_at_report`, what of ours the worker's last report may have counted, the load is the
  others' requests as of that report plus ours now: a burst we just sent counts at once, and a
  request of ours that just ended stops counting at once (the worker's report would keep it for
  up to a second, enough to send a repeated prompt away from the worker that caches it).
  Without it, the maximum of the two, which never counts our requests twice (a sum would).
- `load_weight_blocks = 32`: one more request on a worker weighs as much as prefilling 32 blocks
  (512 tokens at the default 16-token blocks), about the context of one typical chat request.
  NVIDIA Dynamo's router charges the decode blocks of every active request against the prefill
  blocks at weight 1 by default, i.e. one request weighs its context length in blocks; llm-d's
  default scheduler profile similarly weighs its prefix scorer a little above its queue scorer.
  Consequences: a 2k-token cached prefix (128 blocks) beats a worker up to three requests
  busier, and a worker ten requests busier (320) loses unless it saves more than 5k tokens.
- `kv_utilization_weight_blocks = 16`: a full cache costs half a request. It mostly breaks ties
  towards the worker with free blocks, where admitting the request evicts no cached prefix.
Exact ties are broken at random (a seeded `random.Random` makes tests deterministic), so equal
workers share the load instead of the first one in sort order taking all of it.

`least-loaded` minimises the load alone (ties at random); `round-robin` rotates over the sorted
worker ids, continuing after the last one it picked, so a worker joining or leaving the pool
does not restart the rotation.
"""

from __future__ import annotations

import random
import typing
from collections.abc import Sequence
from dataclasses import dataclass

from kvrail.crd.spec import RouterPolicy
from kvrail.errors import ConfigError, KvrailError

Policy = RouterPolicy
POLICIES: tuple[str, ...] = typing.get_args(RouterPolicy)

LOAD_WEIGHT_BLOCKS = 32.0
KV_UTILIZATION_WEIGHT_BLOCKS = 16.0
_TIE_EPSILON = 1e-9


class NoWorkerError(KvrailError):
    """No decode worker can take the request (none registered, ready and compatible)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One decode worker that could take the request, as the router sees it now."""

    worker_id: str
    matched_blocks: int
    """Leading prompt blocks the worker caches (`KvIndex.matched_blocks`)."""
    num_running: int
    num_waiting: int
    """From the worker's etcd record (about a second old)."""
    in_flight: int
    """This router's requests on the worker that have not finished (current)."""
    kv_utilization: float
    in_flight_at_report: int | None = None
    """This router's requests the worker's record may count (`WorkerView`), or None: unknown."""

    @property
    def load(self) -> int:
        """Requests on the worker: the others' as of its last report plus ours now; without
        `in_flight_at_report`, its own last report, or ours if we know of more."""
        reported = self.num_running + self.num_waiting
        if self.in_flight_at_report is None:
            return max(reported, self.in_flight)
        return max(reported - self.in_flight_at_report, 0) + self.in_flight


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker. `score` is the cost the policy minimised (lower is better): blocks for
    kv-aware, requests for least-loaded, 0 for round-robin."""

    worker_id: str
    policy: str
    matched_blocks: int
    score: float


class Chooser:
    """Applies one routing policy. Not thread-safe; round-robin keeps its position here."""

    def __init__(
        self,
        policy: Policy,
        rng: random.Random | None = None,
        *,
        load_weight_blocks: float = LOAD_WEIGHT_BLOCKS,
        kv_utilization_weight_blocks: float = KV_UTILIZATION_WEIGHT_BLOCKS,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"router policy {policy!r} is not one of {POLICIES}")
        if load_weight_blocks < 0 or kv_utilization_weight_blocks < 0:
            raise ConfigError("routing weights must be >= 0")
        self.policy = policy
        self.load_weight_blocks = load_weight_blocks
        self.kv_utilization_weight_blocks = kv_utilization_weight_blocks
        self._rng = rng if rng is not None else random.Random()
        self._last_round_robin: str | None = None

    def choose(self, candidates: Sequence[Candidate], num_prompt_blocks: int) -> Decision:
        """Pick one of `candidates`; raises NoWorkerError when there is none."""
        if not candidates:
            raise NoWorkerError("no ready decode worker")
        if self.policy == "round-robin":
            chosen = self._next_round_robin(candidates)
            return Decision(chosen.worker_id, self.policy, chosen.matched_blocks, 0.0)
        if self.policy == "least-loaded":
            costs = [float(c.load) for c in candidates]
        else:
            costs = [self.kv_cost(c, num_prompt_blocks) for c in candidates]
        best = min(costs)
        tied = [c for c, cost in zip(candidates, costs, strict=True) if cost <= best + _TIE_EPSILON]
        chosen = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        return Decision(chosen.worker_id, self.policy, chosen.matched_blocks, best)

    def kv_cost(self, candidate: Candidate, num_prompt_blocks: int) -> float:
        """The kv-aware cost of sending the request to `candidate` (see the module docstring)."""
        num_prefill_blocks = max(num_prompt_blocks - candidate.matched_blocks, 0)
        utilization = candidate.kv_utilization
        if not 0.0 <= utilization <= 1.0:  # a worker's bad report (or NaN) must not win
            utilization = 1.0
        return (
            num_prefill_blocks
            + self.load_weight_blocks * candidate.load
            + self.kv_utilization_weight_blocks * utilization
        )

    def _next_round_robin(self, candidates: Sequence[Candidate]) -> Candidate:
        by_id = {c.worker_id: c for c in candidates}
        ids = sorted(by_id)
        last = self._last_round_robin
        chosen = next((i for i in ids if last is None or i > last), ids[0])
        self._last_round_robin = chosen
        return by_id[chosen]
