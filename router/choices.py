"""Several choices of one request (`n` > 1, and completions' `best_of`): a job per choice, and
the pieces of all of them as one stream, each tagged with its choice's index.

The prompt is computed once. The first choice (the leader) is dispatched alone; the others wait
for its first token, by which time its prompt's full blocks are in its worker's prefix cache
(prefilled there, or installed there from a prefill worker), and are then sent to that same
worker (`Job.prefer`), where those blocks are prefix hits: each computes only what is left of
the prompt after its last full block, prefills locally, and samples its own first token. A
choice that finds the worker gone is routed as any request is (it then computes its prompt
again). Every choice samples from its own seed, `seed + index` (`choice_seed`), so a seeded
request gets reproducible and different choices, whichever worker prefilled them.

One choice's failure fails the response; closing the stream (a client that leaves) closes every
choice's, which cancels each on its worker. At most `BUFFERED_PIECES` pieces per choice wait for
the client: a slow reader holds the choices back as it holds one back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable, Sequence

from kvrail.router.api.streaming import Piece
from kvrail.router.streams.job import Job
from kvrail.router.tenants import Ticket
from kvrail.sampling import SamplingParams

BUFFERED_PIECES = 4
_INT64 = 2**64
_INT64_MIN = -(2**63)

OnFirst = Callable[[str], None]
"""Called with the worker that sent a choice's first event."""
Start = Callable[[Job, OnFirst | None], AsyncGenerator[Piece, None]]
"""A choice's pieces, from its job (`generate._generate`)."""


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: `seed + index`, wrapped into int64; None stays None."""
    if seed is None:
        return None
    return (seed + index - _INT64_MIN) % _INT64 + _INT64_MIN


def choice_jobs(job: Job, count: int) -> list[Job]:
    """`count` jobs for the choices of `job`: the first is `job` itself, choice i > 0 has the id
    `<id>-<i>` and its own seed."""
    jobs = [job]
    for index in range(1, count):
        sampling: SamplingParams = dataclasses.replace(
            job.sampling, seed=choice_seed(job.sampling.seed, index)
        )
        jobs.append(dataclasses.replace(job, request_id=f"{job.request_id}-{index}",
                                        sampling=sampling))  # fmt: skip
    return jobs


@dataclasses.dataclass(slots=True)
class _Done:
    """A choice's end in the queue: `error` if it failed."""

    error: BaseException | None = None


async def pieces_of(jobs: Sequence[Job], start: Start) -> AsyncGenerator[Piece, None]:
    """Every choice's pieces (their `index` set), each choice's in order; see the module
    docstring. Raises the first choice's error to fail."""
    queue: asyncio.Queue[Piece | _Done] = asyncio.Queue(BUFFERED_PIECES * len(jobs))
    leader_worker: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def first(worker_id: str) -> None:
        if not leader_worker.done():
            leader_worker.set_result(worker_id)

    async def pump(index: int, job: Job, on_first: OnFirst | None) -> None:
        try:
            async with contextlib.aclosing(start(job, on_first)) as pieces:
                async for piece in pieces:
                    await queue.put(dataclasses.replace(piece, index=index))
        except Exception as err:  # handed to the consumer, which raises it
            await queue.put(_Done(err))
        else:
            await queue.put(_Done())
        finally:
            first("")  # a leader that ended without an event: the others go anywhere

    async def followers() -> None:
        worker_id = await leader_worker
        for index, job in enumerate(jobs[1:], 1):
            job = dataclasses.replace(job, prefer=worker_id) if worker_id else job
            pumps.append(asyncio.create_task(pump(index, job, None)))

    pumps = [asyncio.create_task(pump(0, jobs[0], first))]
    follow = asyncio.create_task(followers())
    try:
        left = len(jobs)
        while left:
            item = await queue.get()
            if isinstance(item, _Done):
                if item.error is not None:
                    raise item.error
                left -= 1
                continue
            yield item
    finally:
        follow.cancel()  # first, so that no choice starts after this
        with contextlib.suppress(asyncio.CancelledError):
            await follow
        for task in pumps:
            task.cancel()
        for task in pumps:  # each closes its choice's stream: cancelled on its worker
            with contextlib.suppress(asyncio.CancelledError):
                await task


class SharedTicket:
    """The admission ticket of several choices: each choice releases its share (the prompt and
    its tokens), and the last one releases the ticket once, with the prompt counted once and
    every choice's tokens."""

    def __init__(self, ticket: Ticket, num_prompt_tokens: int, count: int) -> None:
        self._ticket = ticket
        self._prompt = num_prompt_tokens
        self._left = count
        self._generated = 0

    def release(self, used_tokens: int) -> None:
        self._generated += used_tokens - self._prompt
        self._left -= 1
        if self._left == 0:
            self._ticket.release(self._prompt + self._generated)
