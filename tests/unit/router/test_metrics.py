"""The router's lock-free inter-token histogram is exposed exactly as prometheus-client's own
`Histogram` fed the same values one at a time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvrail.router.metrics import LoopHistogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01)


def _exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if not line.startswith("kvrail_gap_seconds_created ")]  # fmt: skip


def test_observing_n_values_at_once_matches_the_client_library_observing_each() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("kvrail_gap_seconds", "gaps", buckets=BUCKETS, registry=theirs)
    histogram = LoopHistogram("kvrail_gap_seconds", "gaps", BUCKETS)
    ours.register(histogram)
    # On a bound (counted in its bucket), below the first, between two, past the last.
    for value, times in [(0.001, 2), (0.0001, 1), (0.003, 3), (0.5, 1), (0.01, 4), (0.0025, 1)]:
        for _ in range(times):
            reference.observe(value)
        histogram.observe(value, times)
    assert _exposition(ours) == _exposition(theirs)
    assert "kvrail_gap_seconds_created " in generate_latest(ours).decode()
