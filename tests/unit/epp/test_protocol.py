"""kvrail.epp.protocol: the EPP protocol's message order and content, one stream at a time."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from google.protobuf.struct_pb2 import Struct

from kvrail.epp.picker import NoEndpoint, Refused, Routed, Shed
from kvrail.epp.protocol import EppStream, Limits, Phase, ProtocolError

FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED


def headers(
    end_of_stream: bool = False, subset: object = None, response_body: int | None = None,
    **extra: str,
) -> ProcessingRequest:  # fmt: skip
    """The request headers; ``response_body``: the gateway's ``protocol_config`` with that
    response body mode (Envoy sends it on a stream's first message), None for none."""
    values = [HeaderValue(key=":method", raw_value=b"POST"), HeaderValue(key="Content-Type",
              raw_value=b"application/json")]  # fmt: skip
    values += [HeaderValue(key=k, raw_value=v.encode()) for k, v in extra.items()]
    message = ProcessingRequest(request_headers=HttpHeaders(
        headers=HeaderMap(headers=values), end_of_stream=end_of_stream))  # fmt: skip
    if subset is not None:
        hint = Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    if response_body is not None:
        message.protocol_config.CopyFrom(ProtocolConfiguration(
            request_body_mode=FULL_DUPLEX, response_body_mode=response_body))  # fmt: skip
    return message


def body(data: bytes, end_of_stream: bool) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=data, end_of_stream=end_of_stream))


def routed_stream(
    stream: EppStream, data: bytes = b"{}", response_body: int | None = FULL_DUPLEX
) -> list[ProcessingResponse]:
    assert stream.feed(headers(response_body=response_body)).responses == ()
    step = stream.feed(body(data, True))
    assert step.pick is not None and step.responses == ()
    return list(stream.picked(Routed(("10.0.0.1:8000", "10.0.0.2:8000"))).responses)


def test_the_headers_response_is_held_until_the_body_ends_then_leads() -> None:
    stream = EppStream(1)
    assert stream.feed(headers()).responses == ()
    assert stream.feed(body(b'{"a":', False)).responses == ()
    step = stream.feed(body(b"1}", True))
    assert step.pick is not None
    assert step.pick.body == b'{"a":1}'
    assert step.pick.headers["content-type"] == "application/json"
    assert step.pick.eligible is None
    first, second = stream.picked(Routed(("10.0.0.1:8000", "10.0.0.2:8000"))).responses
    assert first.WhichOneof("response") == "request_headers"
    common = first.request_headers.response
    assert common.clear_route_cache
    (header,) = common.header_mutation.set_headers
    assert header.header.key == "x-gateway-destination-endpoint"
    assert header.header.raw_value == b"10.0.0.1:8000,10.0.0.2:8000"
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000,10.0.0.2:8000"
    assert second.WhichOneof("response") == "request_body"
    streamed = second.request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b'{"a":1}', True)
    assert stream.phase is Phase.RESPONSE


def test_the_body_goes_back_in_bounded_chunks_in_order() -> None:
    data = bytes(range(256)) * 40  # 10,240 bytes
    stream = EppStream(1, Limits(chunk_bytes=4096))
    chunks = routed_stream(stream, data)[1:]
    bodies = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert [len(b.body) for b in bodies] == [4096, 4096, 2048]
    assert [b.end_of_stream for b in bodies] == [False, False, True]
    assert b"".join(b.body for b in bodies) == data


def test_a_request_without_a_body_is_picked_on_its_headers() -> None:
    stream = EppStream(1)
    step = stream.feed(headers(end_of_stream=True))
    assert step.pick is not None and step.pick.body == b""
    (only,) = stream.picked(Routed(("10.0.0.1:8000",))).responses
    assert only.WhichOneof("response") == "request_headers"


def test_an_empty_final_chunk_still_ends_the_body() -> None:
    stream = EppStream(1)
    stream.feed(headers())
    stream.feed(body(b"abc", False))
    assert stream.feed(body(b"", True)).pick is not None
    _, last = stream.picked(Routed(("10.0.0.1:8000",))).responses
    streamed = last.request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b"abc", True)


def test_request_trailers_end_the_request_and_are_answered_after_the_body() -> None:
    stream = EppStream(1)
    stream.feed(headers())
    stream.feed(body(b"abc", False))
    assert stream.feed(ProcessingRequest(request_trailers=HttpTrailers())).pick is not None
    kinds = [r.WhichOneof("response") for r in stream.picked(Routed(("10.0.0.1:8000",))).responses]
    assert kinds == ["request_headers", "request_body", "request_trailers"]


def test_a_body_over_the_cap_is_refused_413_at_once() -> None:
    stream = EppStream(1, Limits(max_body_bytes=10))
    stream.feed(headers())
    assert stream.feed(body(b"x" * 6, False)).responses == ()
    (refusal,) = stream.feed(body(b"x" * 6, False)).responses
    assert refusal.immediate_response.status.code == 413
    assert "10 bytes" in json.loads(refusal.immediate_response.body)["error"]["message"]
    assert stream.phase is Phase.DONE and stream.status == 413


@pytest.mark.parametrize(("pick", "status"), [(NoEndpoint("none"), 503), (Shed("busy"), 429),
                                             (Routed(()), 503)])  # fmt: skip
def test_refusals_are_immediate_responses(pick: NoEndpoint | Shed | Routed, status: int) -> None:
    stream = EppStream(1)
    stream.feed(headers())
    stream.feed(body(b"{}", True))
    (refusal,) = stream.picked(pick).responses
    immediate = refusal.immediate_response
    assert immediate.status.code == status
    assert json.loads(immediate.body)["error"]["code"] == status
    assert immediate.headers.set_headers[0].header.raw_value == b"application/json"
    assert stream.phase is Phase.DONE


def test_a_refused_pick_answers_its_own_status_and_error_body() -> None:
    stream = EppStream(1)
    stream.feed(headers())
    stream.feed(body(b"not json", True))
    error = {"error": {"message": "bad", "type": "invalid_request_error", "param": "body",
                       "code": None}}  # fmt: skip
    (refusal,) = stream.picked(Refused(400, error)).responses
    immediate = refusal.immediate_response
    assert immediate.status.code == 400
    assert json.loads(immediate.body) == error
    assert immediate.headers.set_headers[0].header.raw_value == b"application/json"
    assert stream.phase is Phase.DONE and stream.status == 400


@pytest.mark.parametrize("subset", [["10.0.0.1:8000", "10.0.0.2"], "10.0.0.1:8000, 10.0.0.2"])
def test_the_subset_hint_is_read_as_a_list_or_a_string(subset: object) -> None:
    stream = EppStream(1)
    stream.feed(headers(subset=subset))
    step = stream.feed(body(b"{}", True))
    assert step.pick is not None
    assert step.pick.eligible == frozenset({"10.0.0.1:8000", "10.0.0.2"})


@pytest.mark.parametrize(
    "subset", [["[FD00:0::1]:8000", "fd00::2"], "[fd00::1]:8000, [fd00:0::2]"]
)  # fmt: skip
def test_an_ipv6_subset_hint_is_normalised_as_endpoints_are(subset: object) -> None:
    stream = EppStream(1)
    stream.feed(headers(subset=subset))
    step = stream.feed(body(b"{}", True))
    assert step.pick is not None
    assert step.pick.eligible == frozenset({"[fd00::1]:8000", "fd00::2"})


def test_ipv6_endpoints_are_named_in_brackets_in_the_header_and_the_metadata() -> None:
    stream = EppStream(1)
    stream.feed(headers(end_of_stream=True))
    (first,) = stream.picked(Routed(("[fd00::1]:8000", "[fd00::2]:8000"))).responses
    (header,) = first.request_headers.response.header_mutation.set_headers
    assert header.header.raw_value == b"[fd00::1]:8000,[fd00::2]:8000"
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == (
        "[fd00::1]:8000,[fd00::2]:8000"
    )


def served_response_headers(endpoint: str) -> ProcessingRequest:
    """The response headers as Envoy sends them: the endpoint it served in `envoy.lb`."""
    response_headers = ProcessingRequest(response_headers=HttpHeaders())
    served = Struct()
    served.update({"x-gateway-destination-endpoint-served": endpoint})
    response_headers.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served)
    return response_headers


def test_response_chunks_are_echoed_and_the_served_endpoint_read_back() -> None:
    stream = EppStream(1)
    routed_stream(stream)
    step = stream.feed(served_response_headers("10.0.0.2:8000"))
    assert step.served == "10.0.0.2:8000"
    assert step.responses[0].WhichOneof("response") == "response_headers"
    for data, end in ((b"data: 1\n\n", False), (b"data: 2\n\n", True)):
        (echo,) = stream.feed(ProcessingRequest(
            response_body=HttpBody(body=data, end_of_stream=end))).responses  # fmt: skip
        streamed = echo.response_body.response.body_mutation.streamed_response
        assert (streamed.body, streamed.end_of_stream) == (data, end)
    assert stream.phase is Phase.DONE


def test_messages_out_of_order_are_protocol_errors() -> None:
    stream = EppStream(1)
    with pytest.raises(ProtocolError, match="response_headers"):
        stream.feed(ProcessingRequest(response_headers=HttpHeaders()))
    stream.feed(headers())
    with pytest.raises(ProtocolError, match="twice"):
        stream.feed(headers())
    with pytest.raises(ProtocolError, match="pick"):
        stream.picked(Routed(("10.0.0.1:8000",)))


@pytest.mark.parametrize("with_body", [True, False])
def test_a_detached_stream_is_done_once_the_routed_request_is_answered(with_body: bool) -> None:
    stream = EppStream(1, detach=True)
    if with_body:
        responses = routed_stream(stream, b'{"a":1}', response_body=ProcessingMode.NONE)
        kinds = [r.WhichOneof("response") for r in responses]
        assert kinds == ["request_headers", "request_body"]
        streamed = responses[1].request_body.response.body_mutation.streamed_response
        assert (streamed.body, streamed.end_of_stream) == (b'{"a":1}', True)
    else:
        step = stream.feed(headers(end_of_stream=True, response_body=ProcessingMode.NONE))
        assert step.pick is not None
        (first,) = stream.picked(Routed(("10.0.0.1:8000",))).responses
        assert first.WhichOneof("response") == "request_headers"
    assert stream.phase is Phase.DONE and stream.detached and stream.detach_blocked is None
    with pytest.raises(ProtocolError, match="phase done"):  # nothing of the response comes here
        stream.feed(ProcessingRequest(response_headers=HttpHeaders()))


@pytest.mark.parametrize(
    ("response_body", "why"),
    [(FULL_DUPLEX, "response_body_mode FULL_DUPLEX_STREAMED"), (None, "no protocol_config")],
)
def test_a_stream_stays_attached_where_the_response_body_would_come_here(
    response_body: int | None, why: str
) -> None:
    """A gateway that streams the response body to the EPP (or does not say) would lose the
    chunks it sends into a closing stream: no detach there, and the stream says why."""
    stream = EppStream(1, detach=True)
    routed_stream(stream, response_body=response_body)
    assert stream.phase is Phase.RESPONSE and not stream.detached
    assert stream.detach_blocked is not None and why in stream.detach_blocked
    stream.feed(ProcessingRequest(response_headers=HttpHeaders()))
    assert stream.phase is Phase.RESPONSE  # the body is echoed as without detach


def test_without_detach_a_stream_without_the_response_body_ends_at_the_response_headers() -> None:
    """The gateway sends no response body: the served endpoint is read back from the response
    headers, and the stream then ends as a detached one (nothing more of it comes here)."""
    stream = EppStream(1)
    routed_stream(stream, response_body=ProcessingMode.NONE)
    assert stream.phase is Phase.RESPONSE and stream.detach_blocked is None
    step = stream.feed(served_response_headers("10.0.0.2:8000"))
    assert step.served == "10.0.0.2:8000"
    assert stream.phase is Phase.DONE and stream.detached


def test_a_refusal_is_not_a_detach() -> None:
    stream = EppStream(1, detach=True)
    stream.feed(headers(end_of_stream=True))
    stream.picked(NoEndpoint("none"))
    assert stream.phase is Phase.DONE and not stream.detached
