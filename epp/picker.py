"""What the EPP asks when it has a whole request: which endpoints, in order, or why none.

The protocol layer (:mod:`kvrail.epp.protocol`) owns the ext_proc stream; a :class:`Picker` owns
the choice and the load it books for it. Bookings are keyed by the stream, and the server calls
:meth:`Picker.finished` exactly once per stream however it ends (response done, client gone
mid-body, an error), so a booking can never outlive its request. A stream that detaches (the
gateway serves the response without the EPP) ends before its request does: the server calls
:meth:`Picker.detached` first, and a picker that learns of the request's end another way keeps
the booking until then, for a bounded time (``KvAwarePicker``: the worker's next report).

:class:`LeastInFlight` picks the fewest requests in flight over a static list of endpoints and
knows nothing of prompts or KV caches; :class:`kvrail.epp.kv_picker.KvAwarePicker` makes the
choice kvrail's router makes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvrail.endpoints import endpoint_ip, parse_endpoint


@dataclasses.dataclass(frozen=True, slots=True)
class PickRequest:
    """One request, whole: its headers (lower-case names), its body bytes, and the endpoints the
    gateway allows (``None``: no subset hint, any endpoint the picker knows)."""

    stream_id: int
    headers: Mapping[str, str]
    body: bytes
    eligible: frozenset[str] | None


@dataclasses.dataclass(frozen=True, slots=True)
class Routed:
    """Send the request to ``endpoints[0]``; the rest are the gateway's fallbacks, in order."""

    endpoints: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Shed:
    """Too busy: the gateway answers 429 with ``reason``."""

    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class NoEndpoint:
    """Nothing eligible: the gateway answers 503 with ``reason``."""

    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    """The request itself is at fault (not JSON, an unknown model, no valid API key): the
    gateway answers ``status`` with ``error``, an OpenAI-style ``{"error": {...}}`` body that
    names the field and never quotes the request."""

    status: int
    error: Mapping[str, object]


Pick = Routed | Shed | NoEndpoint | Refused


class Picker(Protocol):
    """Chooses endpoints for whole requests and books the load of each choice per stream."""

    async def pick(self, request: PickRequest) -> Pick:
        """The endpoints for ``request``. A ``Routed`` pick books load under
        ``request.stream_id`` until :meth:`finished`; the other picks book nothing."""
        ...

    def served(self, stream_id: int, endpoint: str) -> None:
        """The gateway reports the endpoint that actually served the stream (a fallback when the
        primary failed); the booking follows it. Unknown streams are ignored."""
        ...

    def detached(self, stream_id: int) -> None:
        """The stream was routed and the gateway serves the rest of its request without the EPP
        (``detach``); :meth:`finished` follows at once. A picker that can learn of the request's
        end another way keeps its booking until then; the others let ``finished`` release it."""
        ...

    def finished(self, stream_id: int) -> None:
        """The stream ended, however it ended: release whatever it booked, unless
        :meth:`detached` handed the booking over. Idempotent."""
        ...


class LeastInFlight:
    """The endpoint with the fewest streams booked, over a static list; the others follow as
    fallbacks, least busy first. Ties go to the list's order. With ``max_in_flight`` set, an
    endpoint at that many streams is not picked, and when every eligible endpoint is full the
    request is shed (429). Not KV-aware: it never looks at the body."""

    def __init__(self, endpoints: Sequence[str], *, max_in_flight: int | None = None) -> None:
        if not endpoints:
            raise ValueError("endpoints: at least one ip:port is needed")
        normalised = [parse_endpoint(e) for e in endpoints]
        if len(set(normalised)) != len(normalised):
            raise ValueError("endpoints: listed twice: " + ", ".join(sorted(
                {e for e in normalised if normalised.count(e) > 1})))  # fmt: skip
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight: must be at least 1")
        self.endpoints = tuple(normalised)
        self.max_in_flight = max_in_flight
        self.in_flight = dict.fromkeys(self.endpoints, 0)
        self._booked: dict[int, str] = {}

    async def pick(self, request: PickRequest) -> Pick:
        candidates = [e for e in self.endpoints if is_allowed(e, request.eligible)]
        if not candidates:
            return NoEndpoint("no endpoint is eligible for this request")
        if self.max_in_flight is not None:
            candidates = [e for e in candidates if self.in_flight[e] < self.max_in_flight]
            if not candidates:
                return Shed("every eligible endpoint is at its in-flight limit")
        order = sorted(candidates, key=lambda e: self.in_flight[e])  # stable: list order on ties
        self.finished(request.stream_id)  # one booking per stream, even if picked twice
        self._book(request.stream_id, order[0])
        return Routed(tuple(order))

    def served(self, stream_id: int, endpoint: str) -> None:
        booked = self._booked.get(stream_id)
        if booked is None or booked == endpoint or endpoint not in self.in_flight:
            return
        self.finished(stream_id)
        self._book(stream_id, endpoint)

    def detached(self, stream_id: int) -> None:
        """Nothing to keep: a static list learns of no request's end but its stream's, so a
        detached stream's booking ends with it (``kvrail.epp`` refuses ``--detach`` here)."""

    def finished(self, stream_id: int) -> None:
        endpoint = self._booked.pop(stream_id, None)
        if endpoint is not None:
            self.in_flight[endpoint] -= 1

    def _book(self, stream_id: int, endpoint: str) -> None:
        self._booked[stream_id] = endpoint
        self.in_flight[endpoint] += 1


def is_allowed(endpoint: str, eligible: frozenset[str] | None) -> bool:
    """The subset hint names endpoints as ``ip:port`` or a bare ``ip`` (every port of it);
    ``endpoint`` and ``eligible`` normalised (``kvrail.endpoints``: IPv6 ``[addr]:port``, a bare
    IPv6 address without brackets)."""
    if eligible is None:
        return True
    return endpoint in eligible or endpoint_ip(endpoint) in eligible
