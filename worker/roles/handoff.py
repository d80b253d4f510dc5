"""How a remote prefill ends for the decode side (`KvReceiver.prefill`), and how a request
fails with a reason its client sees."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Outcome = Literal["installed", "local", "recompute"]
"""`installed`: the request runs on the KV written here; `local`: nothing was tried, prefill
locally; `recompute`: the remote prefill failed, prefill locally."""


@dataclass(frozen=True, slots=True)
class Handoff:
    """How a remote prefill ended; when installed, the prompt's tokens that came from a prefix
    cache (this worker's, or the writer's)."""

    outcome: Outcome
    num_cached_tokens: int = 0


class RequestFailed(Exception):
    """A request ends with an error event; `reason` is a metric-safe code."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
