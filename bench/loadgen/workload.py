"""Workload generation (pure): prompts from a fixed word list, length distributions, seeded
requests and open-loop arrival schedules."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

Arrival = Literal["poisson", "constant", "closed"]

# Common English nouns, each one token (with its leading space) in the BPE vocabularies of the
# usual open models, so "N words" is about N tokens.
_WORD_TEXT = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea
kid body information back parent face level office door health person art war history
party result change morning reason research girl guy moment air teacher force education
foot boy age policy process music market sense nation plan college interest death
experience effect use class control care field development role effort rate heart drug
show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position
player record paper space ground form event official matter center couple site project
activity star table need court oil situation cost industry figure street image phone data
picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair
window evidence population truth rock"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))


# -- workload (pure) -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lengths:
    """A length distribution in tokens: fixed (`low == high`) or uniform over [low, high]."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"lengths need 1 <= low <= high, got {self.low}-{self.high}")

    @classmethod
    def parse(cls, spec: str) -> Lengths:
        """`N` (fixed) or `A-B` (uniform integers, inclusive)."""
        low, sep, high = spec.strip().partition("-")
        try:
            return cls(int(low), int(high) if sep else int(low))
        except ValueError as err:
            raise ValueError(f"length {spec!r}: expected N or A-B with 1 <= A <= B") from err

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_tokens: Lengths = Lengths(128, 128)
    output_tokens: Lengths = Lengths(64, 64)
    num_prefixes: int = 0
    """Distinct shared system prompts; 0: none."""
    prefix_tokens: int = 0
    long_context_fraction: float = 0.0
    long_context_tokens: Lengths | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prefixes < 0 or self.prefix_tokens < 0:
            raise ValueError("num_prefixes and prefix_tokens must be >= 0")
        if (self.num_prefixes > 0) != (self.prefix_tokens > 0):
            raise ValueError("shared prefixes need both a count and a length")
        if not 0.0 <= self.long_context_fraction <= 1.0:
            raise ValueError("long_context_fraction must be in [0, 1]")
        if self.long_context_fraction > 0 and self.long_context_tokens is None:
            raise ValueError("a long-context fraction needs long_context_tokens")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    is_warmup: bool
    system: str | None
    user: str
    max_tokens: int
    prefix_id: int | None
    is_long: bool

    @property
    def approx_prompt_tokens(self) -> int:
        """Words in the prompt (about its tokens, before any chat template)."""
        return len(self.user.split()) + (len(self.system.split()) if self.system else 0)


def words(num_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def system_prompts(workload: Workload) -> tuple[str, ...]:
    """The workload's shared prefixes: each from its own seeded stream, so prefix k is the same
    whatever the number of prefixes."""
    return tuple(
        words(workload.prefix_tokens, random.Random(f"{workload.seed}:prefix:{k}"))
        for k in range(workload.num_prefixes)
    )


def make_request(
    workload: Workload, prefixes: Sequence[str], index: int, is_warmup: bool
) -> RequestSpec:
    """Request `index` of the workload, from its own seeded stream (independent of the others)."""
    rng = random.Random(f"{workload.seed}:request:{index}")
    is_long = rng.random() < workload.long_context_fraction
    lengths = workload.long_context_tokens if is_long else workload.prompt_tokens
    assert lengths is not None  # Workload checks it
    prefix_id = rng.randrange(len(prefixes)) if prefixes else None
    return RequestSpec(
        index=index,
        is_warmup=is_warmup,
        system=prefixes[prefix_id] if prefix_id is not None else None,
        user=words(lengths.sample(rng), rng),
        max_tokens=workload.output_tokens.sample(rng),
        prefix_id=prefix_id,
        is_long=is_long,
    )


def _gaps(process: Arrival, rate: float, rng: random.Random) -> Iterator[float]:
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
    while True:
        yield rng.expovariate(rate) if process == "poisson" else 1.0 / rate


def arrival_times(
    process: Arrival,
    rate: float,
    seed: int,
    *,
    num_warmup: int = 0,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> list[float]:
    """Send times (seconds from the start) of an open loop: `num_warmup` warm-up arrivals, then
    `num_requests` measured ones or as many as arrive within `duration_s` of the first measured
    one. The first arrival is at 0. Exactly one of `num_requests` and `duration_s` is given."""
    if process not in ("poisson", "constant"):
        raise ValueError(f"not an open-loop arrival process: {process!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests and duration_s")
    if duration_s is not None and (math.isinf(rate) or duration_s <= 0):
        raise ValueError("a duration needs a finite rate and a positive duration")
    if num_warmup < 0 or (num_requests is not None and num_requests < 1):
        raise ValueError("num_warmup must be >= 0 and num_requests >= 1")
    gaps = _gaps(process, rate, random.Random(f"{seed}:arrivals"))
    times = [0.0]
    while len(times) < num_warmup + (num_requests or 1):
        times.append(times[-1] + next(gaps))
    if duration_s is not None:
        end = times[num_warmup] + duration_s
        while (t := times[-1] + next(gaps)) < end:
            times.append(t)
    return times
