"""The outcomes of one attempt in `vllm_stream.VllmStream`: what step 1 (prefill) leaves for step 2
(decode), `Prefilled`, and the failures of one server that the stream catches to try another:
`Retry` (a decode server, before its first event) and `PrefillFailed` (a prefill server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrail.outputs import PrefillMode
from kvrail.router.streams.job import AttemptFailed


@dataclass(frozen=True, slots=True)
class Prefilled:
    """The outcome of step 1 for one decode attempt."""

    mode: PrefillMode
    params: dict[str, Any] | None = None
    fingerprint: str = ""
    seconds: float = 0.0


class Retry(AttemptFailed):
    """The decode attempt failed before its first event; `reusable`: it never connected, so the
    prefill's KV was not read and may go to the next decode server."""

    def __init__(self, reason: str, reusable: bool = False) -> None:
        super().__init__(reason)
        self.reusable = reusable


class PrefillFailed(AttemptFailed):
    """Step 1 failed on one prefill server."""
