"""Cancels remembered for a while, so a cancel that overtakes its request still stops it.

The router publishes a `Cancel` on the pool's cancel subject, which every worker receives, right
after the request itself when the client leaves at once. Nothing orders the two at a worker (the
request and the cancel arrive on different subscriptions; a prefill job may wait in the queue),
so each role remembers every cancel it sees in a `RecentCancels` and refuses a request or job
whose id is in it. Pure: no I/O, and the clock is injected.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_MAX_SIZE = 10_000


class RecentCancels:
    """Request ids cancelled within the last `ttl_s` seconds, at most `max_size` of them.

    A flood of cancels (bogus ids, or the whole pool's cancels, which every worker receives)
    evicts the oldest first, so memory stays bounded at the price of forgetting early. An id
    cancelled again is remembered for another `ttl_s`. `clock` must never go backwards.
    """

    __slots__ = ("_clock", "_expiry", "max_size", "ttl_s")

    def __init__(
        self,
        ttl_s: float,
        max_size: int = DEFAULT_MAX_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self.ttl_s = ttl_s
        self.max_size = max_size
        self._clock = clock
        # id -> when it is forgotten; insertion order is expiry order (one ttl for all).
        self._expiry: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        now = self._clock()
        self._forget_expired(now)
        self._expiry.pop(request_id, None)
        self._expiry[request_id] = now + self.ttl_s
        while len(self._expiry) > self.max_size:
            self._expiry.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        if not isinstance(request_id, str):
            return False
        expiry = self._expiry.get(request_id)
        return expiry is not None and self._clock() < expiry

    def __len__(self) -> int:
        self._forget_expired(self._clock())
        return len(self._expiry)

    def _forget_expired(self, now: float) -> None:
        while self._expiry:
            request_id, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                return
            del self._expiry[request_id]
