"""The GAIE endpoint picker protocol (v1) over one Envoy ext_proc stream, as pure logic.

An :class:`EppStream` is fed the gateway's ``ProcessingRequest`` messages of one HTTP request (the
request body ``FULL_DUPLEX_STREAMED``, its trailers ``SEND``; the response body
``FULL_DUPLEX_STREAMED`` with trailers ``SEND``, or ``NONE``) and answers with the
``ProcessingResponse`` messages the protocol requires. It does no I/O and never awaits: when the
request body is whole it returns a :class:`~kvrail.epp.picker.PickRequest`, the server awaits the
picker, and :meth:`EppStream.picked` turns the answer into responses. The order matters to Envoy:

1. the request-headers response is held until the body's ``end_of_stream`` (or the trailers);
2. it then carries ``clear_route_cache``, the header ``x-gateway-destination-endpoint:
   ip:port[,ip:port...]`` (primary, then fallbacks) and the same value in the dynamic metadata
   ``envoy.lb`` / ``x-gateway-destination-endpoint``, and goes out before any body response
   (Envoy drops a stream whose body response comes first);
3. the held body follows as ``streamed_response`` chunks of at most ``chunk_bytes``;
4. response headers pass unchanged (the served endpoint in their metadata context is read back)
   and response body chunks are echoed as they come, so SSE is not buffered.

A stream made with ``detach`` ends after step 3 instead, when the gateway does not send the
response body to the EPP: the server closes the ext_proc stream with status OK once the routed
request has gone back to the gateway, and Envoy serves the rest of the request (the whole
response) without the EPP. Nothing of the request is still with the EPP then (its body was held
whole and returned), so a routed stream no longer depends on the EPP process: killing or
restarting it does not touch the request. What detaching costs: the served endpoint is not read
back, and the picker learns the request's end some other way (``Picker.detached``).

Whether the gateway sends the response body is read from the ``protocol_config`` of the stream's
first message (Envoy sends its filter's body modes there). Only ``response_body_mode: NONE`` makes
a detach safe. With ``FULL_DUPLEX_STREAMED`` the processor owns every response chunk Envoy sends
it, and Envoy sends them until it has processed the stream's close: a response that reaches Envoy
before that loses the chunks sent into the closing stream (a 200 with an empty body). Envoy 1.40
ignores a ``mode_override`` (skip the response) whenever either body mode of the filter is
``FULL_DUPLEX_STREAMED``, so the EPP cannot switch the response off itself. A gateway that streams
the response body, or that sends no ``protocol_config``, gets a stream that stays attached, as
without ``detach`` (:attr:`EppStream.detach_blocked` says why). In the ``NONE`` case Envoy keeps
the response it holds while it waits for the close, so a late close costs a wait, never bytes.

A stream that does not detach on a gateway that sends no response body ends after step 4's
response headers (the served endpoint read back): the EPP sees nothing of the response after them,
so the stream is then counted as detached too.

A body over ``max_body_bytes`` is answered 413 as soon as it crosses the cap; a ``NoEndpoint``
pick 503, a ``Shed`` pick 429, a ``Refused`` pick its own status (a 400 for a body that is not
JSON, say), each as an ``ImmediateResponse`` with an OpenAI-style error body.
"""

from __future__ import annotations

import dataclasses
import enum
import json

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from kvrail.endpoints import normalise_hint
from kvrail.epp.picker import NoEndpoint, Pick, PickRequest, Refused, Routed, Shed

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"

#: lwepp's chunk size: under Envoy's default 64 KiB gRPC message buffer with room for framing.
DEFAULT_CHUNK_BYTES = 62_000
DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024
_BODY_NONE: int = int(ProcessingMode.NONE)


class ProtocolError(Exception):
    """The gateway sent a message the protocol does not allow at this point of the stream."""


class Phase(enum.Enum):
    REQUEST = "request"  # headers or body chunks still coming
    PICKING = "picking"  # the request is whole; waiting for the picker
    RESPONSE = "response"  # routed; response messages are echoed
    DONE = "done"  # nothing more to answer: the server ends the stream


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError("chunk_bytes: must be at least 1")
        if self.max_body_bytes < 0:
            raise ValueError("max_body_bytes: must not be negative")


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """What one message leads to: responses to send now, a pick to make first, and the endpoint
    the gateway says served the request (once, on the response headers)."""

    responses: tuple[ProcessingResponse, ...] = ()
    pick: PickRequest | None = None
    served: str | None = None


class EppStream:
    """The protocol state of one ext_proc stream (one HTTP request)."""

    def __init__(
        self, stream_id: int, limits: Limits = DEFAULT_LIMITS, *, detach: bool = False
    ) -> None:
        self.stream_id = stream_id
        self.limits = limits
        self.detach = detach
        self.detached = False
        """Routed, and the gateway serves the rest of the request without this stream."""
        self.response_body_mode: int | None = None
        """The gateway's ``response_body_mode`` from ``protocol_config``; None if it sent none."""
        self.detach_blocked: str | None = None
        """Why a stream made with ``detach`` stayed attached once routed, if it did."""
        self.phase = Phase.REQUEST
        self.status: int | None = None  # the ImmediateResponse status, if one was sent
        self.endpoints: tuple[str, ...] = ()
        self._headers: dict[str, str] = {}
        self._eligible: frozenset[str] | None = None
        self._body = bytearray()
        self._has_body = False
        self._trailers = False

    def feed(self, message: ProcessingRequest) -> Step:
        """The answer to one gateway message. ``ProtocolError`` if it comes out of order."""
        kind = message.WhichOneof("request")
        if self.response_body_mode is None and message.HasField("protocol_config"):
            self.response_body_mode = int(message.protocol_config.response_body_mode)
        if self.phase is Phase.REQUEST:
            if kind == "request_headers":
                return self._on_request_headers(message)
            if kind == "request_body":
                return self._on_request_body(message)
            if kind == "request_trailers":
                self._trailers = True
                return self._ready()
        elif self.phase is Phase.RESPONSE:
            if kind == "response_headers":
                return self._on_response_headers(message)
            if kind == "response_body":
                chunk = message.response_body
                if chunk.end_of_stream:
                    self.phase = Phase.DONE
                return Step((_streamed("response_body", chunk.body, chunk.end_of_stream),))
            if kind == "response_trailers":
                self.phase = Phase.DONE
                return Step((ProcessingResponse(response_trailers=TrailersResponse()),))
        raise ProtocolError(f"{kind} is not expected in phase {self.phase.value}")

    def picked(self, pick: Pick) -> Step:
        """The responses for the picker's answer to the :class:`PickRequest` this stream asked."""
        if self.phase is not Phase.PICKING:
            raise ProtocolError(f"a pick is not expected in phase {self.phase.value}")
        if isinstance(pick, NoEndpoint):
            return self._refuse(503, "service_unavailable", pick.reason)
        if isinstance(pick, Shed):
            return self._refuse(429, "too_many_requests", pick.reason)
        if isinstance(pick, Refused):
            return self._immediate(pick.status, dict(pick.error))
        assert isinstance(pick, Routed)
        if not pick.endpoints:
            return self._refuse(503, "service_unavailable", "the picker named no endpoint")
        self.endpoints = pick.endpoints
        if self.detach and not self.response_body_skipped:
            self.detach_blocked = _blocked_reason(self.response_body_mode)
        self.detached = self.detach and self.response_body_skipped
        self.phase = Phase.DONE if self.detached else Phase.RESPONSE
        return Step((_routed_headers(",".join(pick.endpoints)), *self._held_body()))

    @property
    def response_body_skipped(self) -> bool:
        """The gateway said it does not send the response body here (``NONE``)."""
        return self.response_body_mode == _BODY_NONE

    def _on_request_headers(self, message: ProcessingRequest) -> Step:
        if self._headers:
            raise ProtocolError("request_headers sent twice")
        self._headers = _header_dict(message.request_headers)
        self._eligible = _subset_hint(message)
        if message.request_headers.end_of_stream:
            return self._ready()
        return Step()

    def _on_request_body(self, message: ProcessingRequest) -> Step:
        chunk = message.request_body
        self._has_body = True
        if len(self._body) + len(chunk.body) > self.limits.max_body_bytes:
            return self._refuse(
                413, "invalid_request_error",
                f"the request body is over {self.limits.max_body_bytes} bytes",
            )  # fmt: skip
        self._body += chunk.body
        return self._ready() if chunk.end_of_stream else Step()

    def _ready(self) -> Step:
        self.phase = Phase.PICKING
        return Step(pick=PickRequest(
            self.stream_id, self._headers, bytes(self._body), self._eligible))  # fmt: skip

    def _held_body(self) -> list[ProcessingResponse]:
        out: list[ProcessingResponse] = []
        if self._has_body:
            body, size = bytes(self._body), self.limits.chunk_bytes
            pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1 and not self._trailers
                out.append(_streamed("request_body", piece, last))
        self._body.clear()
        if self._trailers:
            out.append(ProcessingResponse(request_trailers=TrailersResponse()))
        return out

    def _on_response_headers(self, message: ProcessingRequest) -> Step:
        if message.response_headers.end_of_stream:
            self.phase = Phase.DONE
        elif self.response_body_skipped:  # nothing more of the response comes here
            self.phase = Phase.DONE
            self.detached = True
        served = _metadata_string(message, LB_NAMESPACE, SERVED_KEY) or None
        ok = ProcessingResponse(response_headers=HeadersResponse(response=CommonResponse()))
        return Step((ok,), served=served)

    def _refuse(self, status: int, kind: str, message: str) -> Step:
        error = {"message": message, "type": kind, "code": status}
        return self._immediate(status, {"error": error})

    def _immediate(self, status: int, error: dict[str, object]) -> Step:
        self.phase = Phase.DONE
        self.status = status
        self._body.clear()
        body = json.dumps(error)
        content_type = HeaderValueOption(header=HeaderValue(
            key="content-type", raw_value=b"application/json"))  # fmt: skip
        return Step((ProcessingResponse(immediate_response=ImmediateResponse(
            status=HttpStatus(code=status),
            headers=HeaderMutation(set_headers=[content_type]),
            body=body.encode(),
            details=f"kvrail_epp_{status}",
        )),))  # fmt: skip


def _blocked_reason(mode: int | None) -> str:
    if mode is None:
        return "the gateway sent no protocol_config, so it may stream the response body here"
    name = ProcessingMode.BodySendMode.Name(mode)
    return f"the gateway sends the response body here (response_body_mode {name})"


def _routed_headers(destination: str) -> ProcessingResponse:
    """The held request-headers response: where to send the request, as header and metadata."""
    header = HeaderValueOption(
        header=HeaderValue(key=DESTINATION_HEADER, raw_value=destination.encode()),
        append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    metadata = Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: destination}})
    return ProcessingResponse(
        request_headers=HeadersResponse(response=CommonResponse(
            header_mutation=HeaderMutation(set_headers=[header]),
            clear_route_cache=True,
        )),
        dynamic_metadata=metadata,
    )  # fmt: skip


def _streamed(field: str, body: bytes, end_of_stream: bool) -> ProcessingResponse:
    streamed = StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    mutation = BodyResponse(response=CommonResponse(
        body_mutation=BodyMutation(streamed_response=streamed)))  # fmt: skip
    return ProcessingResponse(**{field: mutation})


def _header_dict(headers: HttpHeaders) -> dict[str, str]:
    """Header names lower-cased; Envoy sends values as ``raw_value`` bytes (or ``value``)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        key = h.key.lower()
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


def _subset_hint(message: ProcessingRequest) -> frozenset[str] | None:
    """The gateway's subset hint: a list of ``ip:port`` (or ``ip``) strings, or one string of
    them separated by commas, each normalised (``kvrail.endpoints.normalise_hint``: IPv6 as
    ``[addr]:port`` or a bare address). ``None`` when there is no hint; an empty set when it is
    empty."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.WhichOneof("kind") == "list_value":
        items = [v.string_value for v in value.list_value.values]
    else:
        items = value.string_value.split(",")
    return frozenset(normalise_hint(item) for item in items if item.strip())


def _metadata_string(message: ProcessingRequest, namespace: str, key: str) -> str:
    struct = message.metadata_context.filter_metadata.get(namespace)
    if struct is None or key not in struct.fields:
        return ""
    return str(struct.fields[key].string_value)
