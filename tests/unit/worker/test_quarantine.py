"""Quarantined reservations: held until the deadline or until every granted writer reported."""

from __future__ import annotations

from kvrail.worker.roles.quarantine import Quarantine


def test_a_request_is_released_when_every_granted_writer_reported() -> None:
    q = Quarantine()
    q.hold("engine-1", ["job-1", "job-1~r1"], release_at_monotonic=100.0)
    assert "engine-1" in q and q.engine_ids() == {"engine-1"}
    assert q.report("job-1")
    assert q.take_releasable(0.0) == (set(), set())  # one writer still outstanding
    assert "engine-1" in q
    assert q.report("job-1~r1")
    assert q.take_releasable(0.0) == ({"engine-1"}, set())
    assert "engine-1" not in q and q.take_releasable(0.0) == (set(), set())


def test_a_request_is_released_at_its_deadline_and_its_jobs_expire() -> None:
    q = Quarantine()
    q.hold("engine-1", ["job-1"], release_at_monotonic=10.0)
    q.hold("engine-2", ["job-2"], release_at_monotonic=20.0)
    assert q.take_releasable(9.9) == (set(), set())
    assert q.take_releasable(10.0) == ({"engine-1"}, {"job-1"})
    assert q.engine_ids() == {"engine-2"}
    assert not q.report("job-1")  # a late report of an expired job changes nothing


def test_clear_returns_everything_still_to_free() -> None:
    q = Quarantine()
    q.hold("engine-1", ["job-1"], 10.0)
    q.report("job-1")  # lifted, not yet taken
    q.hold("engine-2", ["job-2"], 10.0)
    assert q.clear() == {"engine-1", "engine-2"}
    assert q.engine_ids() == set() and q.take_releasable(100.0) == (set(), set())
