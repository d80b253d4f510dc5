"""Results and statistics (pure): what the client saw of each request, percentiles, SLOs and a
load point's summary."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

ItlStat = Literal["p99", "max"]


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds."""

    index: int
    is_warmup: bool
    start_s: float
    """Send time since the load point began."""
    end_s: float
    """End of the stream (or the error) since the load point began."""
    chunk_times_s: list[float] = field(default_factory=list)
    """Arrival of each text-carrying chunk, since the send."""
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    approx_prompt_tokens: int = 0
    prefix_id: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    response_id: str | None = None
    """The server's id of the response (the chunks' `id`), to find the request in its logs."""

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def gaps_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot_s(self) -> float | None:
        ttft = self.ttft_s
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None = None
    itl_s: float | None = None
    itl_stat: ItlStat = "p99"
    tpot_s: float | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between order statistics (numpy's
    default method); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} not in [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else None,
        "count": len(values),
    }


def request_itl_s(result: RequestResult, stat: ItlStat) -> float | None:
    """The request's own ITL statistic: p99 or max of its gaps; None without gaps."""
    gaps = result.gaps_s
    if not gaps:
        return None
    return max(gaps) if stat == "max" else percentile(gaps, 99)


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """Completed, and within every bound `slo` gives (a request without gaps meets the ITL one,
    one without a TPOT meets the TPOT one)."""
    if result.error is not None or result.ttft_s is None:
        return False
    if slo.ttft_s is not None and result.ttft_s > slo.ttft_s:
        return False
    itl = request_itl_s(result, slo.itl_stat)
    if slo.itl_s is not None and itl is not None and itl > slo.itl_s:
        return False
    tpot = result.tpot_s
    return not (slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s)


def summarize(results: Sequence[RequestResult], slo: Slo) -> dict[str, Any]:
    """Statistics of the measured (non-warm-up) requests; see the module docstring."""
    measured = [r for r in results if not r.is_warmup]
    done = [r for r in measured if r.error is None]
    window_s = (
        max(r.end_s for r in measured) - min(r.start_s for r in measured) if measured else 0.0
    )

    def per_s(n: float) -> float | None:
        return n / window_s if window_s > 0 else None

    starts = sorted(r.start_s for r in measured)
    arrival_span_s = starts[-1] - starts[0] if starts else 0.0
    num_good = sum(meets_slo(r, slo) for r in measured)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    prompt = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {
        "num_requests": len(measured),
        "num_warmup": len(results) - len(measured),
        "num_completed": len(done),
        "num_errors": len(measured) - len(done),
        "errors": dict(sorted(Counter(r.error for r in measured if r.error).items())),
        "window_s": window_s,
        # What the schedule really offered: a Poisson sample of n arrivals strays from its rate.
        "arrival_rate_per_s": (len(starts) - 1) / arrival_span_s if arrival_span_s > 0 else None,
        "requests_per_s": per_s(len(done)),
        "output_tokens_per_s": per_s(sum(r.output_tokens for r in done)),
        "ttft_s": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_s": distribution([g for r in done for g in r.gaps_s]),
        "tpot_s": distribution([t for r in done if (t := r.tpot_s) is not None]),
        "e2e_s": distribution([r.e2e_s for r in done]),
        "output_tokens": distribution([float(r.output_tokens) for r in done]),
        "prompt_tokens": distribution([float(p) for p in prompt]),
        "approx_prompt_tokens": distribution([float(r.approx_prompt_tokens) for r in done]),
        "cached_prompt_tokens_total": sum(cached) if cached else None,
        "goodput": {
            "slo": asdict(slo),
            "num_good": num_good,
            "requests_per_s": per_s(num_good),
            "attainment": num_good / len(measured) if measured else None,
        },
    }
