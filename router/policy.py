"""Which decode worker gets a request (pure: candidates in, decision out).

A policy that scores is a profile: scorers under weights. A scorer is a small pure function of a
candidate and the prompt's length in blocks that returns a cost (lower is better); the chooser
minimises the weighted sum of its profile's scorers. A new signal (say, network locality) is one
more scorer in `SCORERS`, one more name in `kvrail.crd.spec.ScorerName` and a weight, never a
branch (KV tiers are not a new signal: `prefix-cache` prices them, see below).
The scorers are importable on their own for other pickers (a Gateway API endpoint picker).

`kv-aware` (the default) is the profile `prefix-cache` 1, `load` 32, `kv-utilization` 16, so it
minimises, in units of prompt blocks,

    cost = (num_prompt_blocks - matched_blocks)                      blocks to prefill
         + 0.2 * num_host_blocks + 0.4 * num_disk_blocks             blocks to load
         + 32 * max(num_running + num_waiting, in_flight)            load
         + 16 * kv_utilization

and the InferencePool's `router.scorers` (`Settings.router_scorers`) may replace those weights.
Why these terms and weights:
- Blocks to prefill: the work a cached prefix saves, and what time to first token grows with.
- Blocks to load: a prefix block a worker holds only in a lower KV tier (host memory or disk,
  `Candidate.num_host_blocks`/`num_disk_blocks`) is loaded back to the GPU before the request is
  scheduled: cheaper than computing it, dearer than a GPU hit (free). `prefix-cache` prices it
  (`HOST_BLOCK_COST`, `DISK_BLOCK_COST`, in computed blocks) rather than a scorer of its own: a
  load and a prefill are one quantity, the prompt's work before its first token, and a separate
  weight could price a load above the recomputation it replaces. Llama-3-8B (16-token blocks,
  2 MiB of bf16 KV each) prefills about 10k tokens/s on one H100/H200, 1.6 ms a block; its
  host-to-device copy at 25-50 GB/s (PCIe 5, pinned) takes 40-85 us, 3-5% of that. A host block
  is charged 0.2: the copy, plus the checksum verified on every load, the request's wait until
  all its blocks are resident (its own load does not overlap its prefill), and the chance the
  block left the tier in the second the index lags. A disk block is charged 0.4: an NVMe read at
  3-7 GB/s takes 0.3-0.7 ms (20-45% of computing it), then the same host copy and checks.
  A worker with no lower tiers has no such blocks and costs what it did before the tiers. So a
  2k-token prefix (128 blocks) in host memory costs 26 instead of 128: its worker wins over one
  that would compute it and has up to three fewer requests, and loses to a GPU hit on a worker
  as busy.
- Load: `num_running`/`num_waiting` are the worker's own counts but reach us through etcd about a
  second late; `in_flight` is this router's requests on the worker, known at once. With
  `in_flight_at_report`, what of ours the worker's last report may have counted, the load is the
  others' requests as of that report plus ours now: a burst we just sent counts at once, and a
  request of ours that just ended stops counting at once (the worker's report would keep it for
  up to a second, enough to send a repeated prompt away from the worker that caches it).
  Without it, the maximum of the two, which never counts our requests twice (a sum would).
- `load` weight 32: one more request on a worker weighs as much as prefilling 32 blocks
  (512 tokens at the default 16-token blocks), about the context of one typical chat request.
  NVIDIA Dynamo's router charges the decode blocks of every active request against the prefill
  blocks at weight 1 by default, i.e. one request weighs its context length in blocks; llm-d's
  default scheduler profile similarly weighs its prefix scorer a little above its queue scorer.
  Consequences: a 2k-token cached prefix (128 blocks) beats a worker up to three requests
  busier, and a worker ten requests busier (320) loses unless it saves more than 5k tokens.
- `kv-utilization` weight 16: a full cache costs half a request. It mostly breaks ties
  towards the worker with free blocks, where admitting the request evicts no cached prefix.
Exact ties are broken at random (a seeded `random.Random` makes tests deterministic), so equal
workers share the load instead of the first one in sort order taking all of it.

`least-loaded` is the profile `load` 1 (ties at random). `round-robin` is a picker, not a
profile: it rotates over the sorted worker ids, continuing after the last one it picked, so a
worker joining or leaving the pool does not restart the rotation.
"""

from __future__ import annotations

import random
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvrail.crd.spec import RouterPolicy, ScorerName
from kvrail.errors import ConfigError, KvrailError

Policy = RouterPolicy
POLICIES: tuple[str, ...] = typing.get_args(RouterPolicy)
SCORER_NAMES: tuple[str, ...] = typing.get_args(ScorerName)

_TIE_EPSILON = 1e-9


class NoWorkerError(KvrailError):
    """No decode worker can take the request (none registered, ready and compatible)."""


@dataclass(slots=True)
class Candidate:
    """One decode worker that could take the request, as the router sees it now. Built afresh
    for each request and never changed; not frozen because a frozen dataclass is four times as
    dear to build (2 us against 0.5), and a request builds one per worker (256 of them: 0.5 ms
    against 0.13, `bench/epp/decision.py`)."""

    worker_id: str
    matched_blocks: int
    """Leading prompt blocks the worker caches in any KV tier (`KvIndex.match_tiers`)."""
    num_running: int
    num_waiting: int
    """From the worker's etcd record (about a second old)."""
    in_flight: int
    """This router's requests on the worker that have not finished (current)."""
    kv_utilization: float
    in_flight_at_report: int | None = None
    """This router's requests the worker's record may count (`WorkerView`), or None: unknown."""
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    """Of `matched_blocks`, those the worker would load from its host-memory or disk KV tier
    before using them (`KvIndex.match_tiers`; the rest are GPU hits)."""

    @property
    def load(self) -> int:
        """Requests on the worker: the others' as of its last report plus ours now; without
        `in_flight_at_report`, its own last report, or ours if we know of more."""
        reported = self.num_running + self.num_waiting
        if self.in_flight_at_report is None:
            return max(reported, self.in_flight)
        return max(reported - self.in_flight_at_report, 0) + self.in_flight


Scorer = Callable[[Candidate, int], float]
"""A cost of sending a request of `num_prompt_blocks` blocks to a candidate, lower is better.
Pure: a function of its arguments alone, so any picker may call it, in any order."""


HOST_BLOCK_COST = 0.2
"""What loading one prompt block from a worker's host-memory tier costs, in computed blocks."""
DISK_BLOCK_COST = 0.4
"""What loading one prompt block from a worker's disk tier costs, in computed blocks."""


def prefix_cache_cost(candidate: Candidate, num_prompt_blocks: int) -> float:
    """Prompt blocks the candidate does not cache, which it would prefill (never below 0), plus
    those it caches only in a lower tier at their load's price (the module docstring says why):
    0 to `num_prompt_blocks`, and exactly the blocks to prefill for a worker with no tiers."""
    matched = min(candidate.matched_blocks, num_prompt_blocks)
    num_host = min(max(candidate.num_host_blocks, 0), matched)
    num_disk = min(max(candidate.num_disk_blocks, 0), matched - num_host)
    return float(num_prompt_blocks - matched) + (
        HOST_BLOCK_COST * num_host + DISK_BLOCK_COST * num_disk
    )


def load_cost(candidate: Candidate, num_prompt_blocks: int) -> float:
    """Requests on the candidate (`Candidate.load`)."""
    return float(candidate.load)


def kv_utilization_cost(candidate: Candidate, num_prompt_blocks: int) -> float:
    """The candidate's KV-cache utilization, 0 to 1; a report outside that (or NaN) counts as a
    full cache, so a worker's bad report never wins."""
    utilization = candidate.kv_utilization
    return utilization if 0.0 <= utilization <= 1.0 else 1.0


SCORERS: Mapping[str, Scorer] = {
    "prefix-cache": prefix_cache_cost,
    "load": load_cost,
    "kv-utilization": kv_utilization_cost,
}
"""Every scorer by the name the InferencePool's `router.scorers` gives it (`ScorerName`)."""


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    """One scorer of a profile and the weight its cost is multiplied by (>= 0)."""

    name: str
    weight: float


PROFILES: Mapping[str, tuple[WeightedScorer, ...]] = {
    "kv-aware": (
        WeightedScorer("prefix-cache", 1.0),
        WeightedScorer("load", 32.0),
        WeightedScorer("kv-utilization", 16.0),
    ),
    "least-loaded": (WeightedScorer("load", 1.0),),
}
"""The policies that score, and their default weights (see the module docstring)."""


def weighted_cost(
    profile: Sequence[WeightedScorer], candidate: Candidate, num_prompt_blocks: int
) -> float:
    """The profile's cost of sending the request to `candidate`: its scorers' weighted sum."""
    return sum(
        w.weight * SCORERS[w.name](candidate, num_prompt_blocks) for w in profile if w.weight
    )


def check_profile(profile: Sequence[WeightedScorer]) -> None:
    """Raises ConfigError unless every scorer is known and named once, every weight is >= 0 and
    one is above 0 (the InferencePool's CEL rules, for settings that did not come through it)."""
    names = [w.name for w in profile]
    unknown = sorted(set(names) - set(SCORERS))
    if unknown:
        raise ConfigError(f"router scorers {unknown} are not among {SCORER_NAMES}")
    if len(set(names)) != len(names):
        raise ConfigError(f"router scorers name one scorer twice: {names}")
    if any(not w.weight >= 0 for w in profile):
        raise ConfigError("routing weights must be >= 0")
    if not any(w.weight > 0 for w in profile):
        raise ConfigError("routing needs a scorer with a weight above 0")


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker. `score` is the cost the policy minimised (lower is better): blocks for
    kv-aware, requests for least-loaded, 0 for round-robin."""

    worker_id: str
    policy: str
    matched_blocks: int
    score: float


def holding_peer(
    peers: Sequence[Candidate], held_blocks: int, num_prompt_blocks: int
) -> Candidate | None:
    """The decode worker of `peers` to prefill a prompt of `num_prompt_blocks` full blocks for
    another, when the best prefill of it otherwise starts from `held_blocks` cached blocks: the
    peer holding the most of the prefix (in any KV tier; ties: the least loaded), if it holds
    more and what it would compute is no more than what it saves, so moving its blocks is most
    of the work (a peer's own decode steps carry that prefill); None otherwise."""
    best = min(peers, key=lambda c: (-c.matched_blocks, c.load), default=None)
    if best is None:
        return None
    saved = best.matched_blocks - held_blocks
    return best if saved > 0 and num_prompt_blocks - best.matched_blocks <= saved else None


class Chooser:
    """Applies one routing policy. Not thread-safe; round-robin keeps its position here.

    `scorers` replaces the kv-aware profile's (a scorer not listed is not used); None keeps the
    policy's own weights. Raises ConfigError for an unknown policy or an invalid profile."""

    def __init__(
        self,
        policy: Policy,
        rng: random.Random | None = None,
        *,
        scorers: Sequence[WeightedScorer] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"router policy {policy!r} is not one of {POLICIES}")
        if scorers is not None and policy != "kv-aware":
            raise ConfigError(f"router scorers weigh the kv-aware policy, not {policy}")
        profile = tuple(scorers) if scorers is not None else PROFILES.get(policy, ())
        if policy in PROFILES:
            check_profile(profile)
        self.policy = policy
        self.profile = profile
        self._terms = tuple((SCORERS[w.name], w.weight) for w in profile if w.weight)
        self._rng = rng if rng is not None else random.Random()
        self._last_round_robin: str | None = None

    def choose(self, candidates: Sequence[Candidate], num_prompt_blocks: int) -> Decision:
        """Pick one of `candidates`; raises NoWorkerError when there is none."""
        return self.ranked(candidates, num_prompt_blocks, 1)[0]

    def ranked(
        self, candidates: Sequence[Candidate], num_prompt_blocks: int, n: int
    ) -> list[Decision]:
        """`choose`'s pick, then up to `n - 1` other candidates as fallbacks, cheapest first
        (round-robin: in the rotation's order), from one scoring pass; raises NoWorkerError
        when there is no candidate."""
        if not candidates:
            raise NoWorkerError("no ready decode worker")
        if self.policy == "round-robin":
            chosen = self._next_round_robin(candidates)
            ids = sorted(c.worker_id for c in candidates)
            start = ids.index(chosen.worker_id)
            by_id = {c.worker_id: c for c in candidates}
            order = [by_id[i] for i in (ids[start:] + ids[:start])[:n]]
            return [Decision(c.worker_id, self.policy, c.matched_blocks, 0.0) for c in order]
        cost = self.cost
        costs = [cost(c, num_prompt_blocks) for c in candidates]
        best = min(costs)
        tied = [c for c, cost in zip(candidates, costs, strict=True) if cost <= best + _TIE_EPSILON]
        chosen = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        out = [Decision(chosen.worker_id, self.policy, chosen.matched_blocks, best)]
        if n > 1:
            rest = sorted((cost, i) for i, cost in enumerate(costs) if candidates[i] is not chosen)[
                : n - 1
            ]
            out += [
                Decision(candidates[i].worker_id, self.policy, candidates[i].matched_blocks, cost)
                for cost, i in rest
            ]
        return out

    def cost(self, candidate: Candidate, num_prompt_blocks: int) -> float:
        """What this chooser's profile charges for sending the request to `candidate`."""
        total = 0.0  # a loop, not sum() over a generator: this runs per candidate per request
        for scorer, weight in self._terms:
            total += weight * scorer(candidate, num_prompt_blocks)
        return total

    def _next_round_robin(self, candidates: Sequence[Candidate]) -> Candidate:
        by_id = {c.worker_id: c for c in candidates}
        ids = sorted(by_id)
        last = self._last_round_robin
        chosen = next((i for i in ids if last is None or i > last), ids[0])
        self._last_round_robin = chosen
        return by_id[chosen]
