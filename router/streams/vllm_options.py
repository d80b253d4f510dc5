"""How the router reaches a pool's vLLM servers: `VllmOptions`, built once by `__main__` from the
settings and shared by every `VllmStream`, and the connect timeout of each request to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

import httpx

from kvrail.crd.spec import KvLoadFailurePolicy
from kvrail.router.policy import Chooser

CONNECT_TIMEOUT_S = 5.0
"""At most this long to connect to a vLLM server, so a dead address leaves time for another."""
FAILURE_POLICIES: tuple[KvLoadFailurePolicy, ...] = get_args(KvLoadFailurePolicy)


@dataclass(slots=True)
class VllmOptions:
    """How the router reaches a pool's vLLM servers (one per router; see `__main__`)."""

    http: httpx.AsyncClient
    """Shared by every request; the router closes it on shutdown."""
    served_name: str
    """The `model` both steps send (vLLM's `--served-model-name`)."""
    min_remote_prefill_tokens: int = 512
    kv_load_failure_policy: KvLoadFailurePolicy = "recompute"
    prefill_timeout_s: float = 30.0
    on_prefill_failure: Callable[[str], None] | None = None
    """Called with a metric-safe reason per failed prefill attempt."""
    prefill_chooser: Chooser = field(default_factory=lambda: Chooser("least-loaded"))

    def __post_init__(self) -> None:
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {FAILURE_POLICIES}")
        if not self.served_name:
            raise ValueError("VllmOptions needs the served model name")
