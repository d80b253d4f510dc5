"""What a request stream is given, what it may ask of its dispatcher, and what it promises:
`Job`, `Workers`, `DispatchError`, `EventStream`.

One module below both stream kinds (`token_stream.TokenStream` for kvrail's workers over NATS,
`vllm_stream.VllmStream` for vLLM servers over HTTP) and the dispatcher that opens them, so none
of them imports another.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

from kvrail.messages import WorkerRecord
from kvrail.outputs import TokenEvent
from kvrail.router.policy import Candidate, Decision
from kvrail.sampling import SamplingParams

CancelReason = Literal["client_disconnect", "deadline", "error", "stop"]
Engine = Literal["kvrail", "vllm"]


class DispatchError(Exception):
    """The request failed; `code` is a metric-safe reason (a worker error code or our own), and
    `param` the request field at fault, where one is."""

    def __init__(self, code: str, detail: str = "", param: str | None = None) -> None:
        super().__init__(detail or code)
        self.code = code
        self.param = param


class AttemptFailed(Exception):
    """One attempt on one worker failed before the client saw anything, for a metric-safe
    `reason`; the caller may try another worker."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Job:
    """What the router sends, already tokenized and admitted."""

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    deadline_unix_s: float
    tenant_salt: str = ""
    prefer: str = ""
    """A worker to send it to while it is a candidate (another choice of the same request holds
    the prompt's KV there); "" or gone: the router's policy chooses."""

    @property
    def deadline_monotonic(self) -> float:
        return time.monotonic() + (self.deadline_unix_s - time.time())


class EventStream(Protocol):
    """One request's `TokenEvent`s, whichever engine serves it.

    Guarantees: events come in order with `seq` from 0; the first says how the prompt was
    prefilled (`prefill_mode`); the last has a `finish_reason` or an `error`. Iterating raises
    `DispatchError` (its code metric-safe) and retries on another worker only while nothing
    changed hands. `worker_id` and `decision` name the worker of the current attempt.
    `cancel()` stops the request on every worker (idempotent; a no-op once it finished) and
    `close()` also releases what the stream holds; `Dispatcher.open` always calls `close()`.
    """

    worker_id: str
    decision: Decision | None

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...

    async def cancel(self, reason: CancelReason) -> None: ...

    async def close(self, reason: CancelReason = "client_disconnect") -> None: ...


class Workers(Protocol):
    """What a stream may ask of the dispatcher that opened it (`Dispatcher` implements it)."""

    max_attempts: int
    """At most this many workers try one request."""

    def record(self, worker_id: str) -> WorkerRecord | None:
        """`worker_id`'s record as last seen in etcd; None when it has none (gone)."""
        ...

    def choose(self, job: Job, exclude: set[str], engines: tuple[Engine, ...]) -> Decision:
        """A ready decode worker of `engines` for `job`, none of `exclude`; raises
        `NoWorkerError` when there is none."""
        ...

    def prefill_candidates(self, fingerprint: str, engines: tuple[Engine, ...]) -> list[Candidate]:
        """The ready prefill workers of `engines` with `fingerprint`, with their load."""
        ...

    def prefill_worker_for(self, job: Job, decision: Decision) -> str:
        """The kvrail prefill worker to send the remote prefill of `job` to, when its decode
        worker is `decision`'s: one holding more of the prompt's prefix than that worker, or ""
        (any prefill worker)."""
        ...

    def count_in_flight(self, worker_id: str, delta: int) -> None:
        """Count a request in flight on `worker_id` (+1) or no longer (-1)."""
        ...
