"""Several choices of one request (`router/choices.py`): a job per choice with its own seed,
the followers sent after the leader's first piece to the leader's worker, every choice's pieces
tagged with its index, one failure failing all, and closing closing every choice."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from kvrail.router.api.errors import ApiError
from kvrail.router.api.streaming import Piece
from kvrail.router.choices import (
    SharedTicket,
    choice_jobs,
    choice_seed,
    pieces_of,
)
from kvrail.router.streams.job import Job
from kvrail.sampling import SamplingParams

JOB = Job("cmpl-1", (1, 2, 3), SamplingParams(max_tokens=4, seed=7), 1e12)


def test_each_choice_has_its_id_and_seed_and_seeds_wrap_in_int64() -> None:
    jobs = choice_jobs(JOB, 3)
    assert [j.request_id for j in jobs] == ["cmpl-1", "cmpl-1-1", "cmpl-1-2"]
    assert [j.sampling.seed for j in jobs] == [7, 8, 9]
    assert all(j.token_ids == JOB.token_ids and j.sampling.max_tokens == 4 for j in jobs)
    assert choice_seed(None, 3) is None
    assert choice_seed(2**63 - 1, 1) == -(2**63)


class Choices:
    """Stand-in pieces per choice: records when each choice started, with which job, and
    whether its generator was closed (as `generate._generate` closes its stream)."""

    def __init__(self, tokens: int = 3, fail: int | None = None) -> None:
        self.tokens, self.fail = tokens, fail
        self.started: list[Job] = []
        self.closed: set[str] = set()
        self.leader_sent = 0

    async def start(self, job: Job, on_first: Any) -> AsyncGenerator[Piece, None]:
        self.started.append(job)
        leader = job.request_id == "cmpl-1"
        try:
            for i in range(self.tokens):
                if leader and i == 0:
                    on_first("worker-a")
                if not leader and i == 0:
                    assert self.leader_sent >= 1, "a follower started before the leader's first"
                if self.fail is not None and job.request_id.endswith(f"-{self.fail}"):
                    raise ApiError(500, "worker lost")
                self.leader_sent += leader
                yield Piece(f"{job.request_id}:{i}", "stop" if i == self.tokens - 1 else None, i)
                await asyncio.sleep(0)
        finally:
            self.closed.add(job.request_id)


async def _all(pieces: AsyncGenerator[Piece, None]) -> list[Piece]:
    return [p async for p in pieces]


def test_followers_go_to_the_leaders_worker_after_its_first_piece_tagged_by_index() -> None:
    choices = Choices()
    got = asyncio.run(_all(pieces_of(choice_jobs(JOB, 3), choices.start)))
    assert [j.prefer for j in choices.started] == ["", "worker-a", "worker-a"]
    for index in range(3):
        mine = [p.text for p in got if p.index == index]
        rid = choice_jobs(JOB, 3)[index].request_id
        assert mine == [f"{rid}:0", f"{rid}:1", f"{rid}:2"]
    assert choices.closed == {"cmpl-1", "cmpl-1-1", "cmpl-1-2"}


def test_one_failing_choice_fails_the_response_and_closes_every_other() -> None:
    choices = Choices(tokens=50, fail=2)
    with pytest.raises(ApiError):
        asyncio.run(_all(pieces_of(choice_jobs(JOB, 3), choices.start)))
    assert choices.closed == {"cmpl-1", "cmpl-1-1", "cmpl-1-2"}


def test_a_client_that_leaves_closes_every_choice() -> None:
    async def leave() -> None:
        pieces = pieces_of(choice_jobs(JOB, 4), choices.start)
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                if piece.index == 3:
                    break

    choices = Choices(tokens=1000)
    asyncio.run(leave())
    assert choices.closed == {"cmpl-1", "cmpl-1-1", "cmpl-1-2", "cmpl-1-3"}


class Ticket:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, used_tokens: int) -> None:
        self.released.append(used_tokens)


def test_a_shared_ticket_counts_the_prompt_once_and_releases_after_the_last_choice() -> None:
    ticket = Ticket()
    shared = SharedTicket(ticket, 10, 3)  # type: ignore[arg-type]
    shared.release(10 + 4)
    shared.release(10 + 2)
    assert ticket.released == []
    shared.release(10 + 5)
    assert ticket.released == [21]
