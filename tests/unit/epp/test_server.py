"""kvrail.epp.server.ExtProc and the entry point's settings, without a network."""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProtocolConfiguration,
)

from kvrail.epp.__main__ import parse_args, settings
from kvrail.epp.picker import LeastInFlight, Pick, PickRequest
from kvrail.epp.server import ExtProc, bind_address

A = "10.0.0.1:8000"


class Failing(LeastInFlight):
    async def pick(self, request: PickRequest) -> Pick:
        raise RuntimeError(f"cannot read {request.body!r}")


async def messages(*items: ProcessingRequest) -> AsyncIterator[ProcessingRequest]:
    for item in items:
        yield item


def request(
    body: bytes, response_body: int = ProcessingMode.FULL_DUPLEX_STREAMED
) -> tuple[ProcessingRequest, ProcessingRequest]:
    """A whole request, from a gateway whose filter has that response body mode."""
    config = ProtocolConfiguration(request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED,
                                   response_body_mode=response_body)  # fmt: skip
    return (ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap()),
                              protocol_config=config),
            ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)))  # fmt: skip


async def test_a_failing_picker_answers_503_and_keeps_the_body_out_of_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ext_proc = ExtProc(Failing([A]))
    context: Any = None
    with caplog.at_level(logging.DEBUG, logger="kvrail.epp"):
        out = [r async for r in ext_proc.Process(messages(*request(b"secret prompt")), context)]
    (refusal,) = out
    assert refusal.immediate_response.status.code == 503
    assert "RuntimeError" in json.loads(refusal.immediate_response.body)["error"]["message"]
    assert "secret" not in caplog.text and "RuntimeError" in caplog.text
    assert ext_proc.open_streams == 0


async def test_a_stream_that_stops_mid_request_releases_its_booking() -> None:
    picker = LeastInFlight([A])
    ext_proc = ExtProc(picker)
    context: Any = None
    responses = ext_proc.Process(messages(*request(b"{}")), context)
    first = await anext(responses)  # routed and booked; the gateway goes away here
    assert first.WhichOneof("response") == "request_headers"
    assert picker.in_flight == {A: 1}
    await responses.aclose()
    assert picker.in_flight == {A: 0}
    assert ext_proc.open_streams == 0


@pytest.mark.parametrize(
    ("argv", "problem"),
    [(["--endpoints", "pod:80"], "--endpoints"), (["--endpoints", A, "--port", "70000"], "--port"),
     (["--endpoints", A, "--max-in-flight", "0"], "--max-in-flight"),
     (["--endpoints", A, "--chunk-bytes", "0"], "--chunk-bytes"),
     (["--endpoints", A, "--metrics-port", "-1"], "--metrics-port"),
     (["--endpoints", A, "--health-port", "9002"], "must differ"),
     (["--endpoints", A, "--cert-path", "/x", "--no-secure-serving"], "--cert-path"),
     (["--num-endpoints", "0"], "--num-endpoints"), (["--max-in-flight", "4"], "--max-in-flight")],
)  # fmt: skip
def test_bad_settings_name_the_option(argv: list[str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        settings(parse_args(argv))


def test_good_settings_make_a_picker_and_limits() -> None:
    picker, limits = settings(parse_args(["--endpoints", f"{A},10.0.0.2:8000", "--max-in-flight",
                                          "4", "--max-body-bytes", "1000"]))  # fmt: skip
    assert picker is not None
    assert picker.endpoints == (A, "10.0.0.2:8000") and picker.max_in_flight == 4
    assert limits.max_body_bytes == 1000


def test_tls_is_the_default_with_health_in_plaintext_on_its_own_port() -> None:
    args = parse_args([])
    assert args.secure_serving and args.cert_path is None
    assert (args.port, args.health_port, args.metrics_port) == (9002, 9003, 9090)
    assert not parse_args(["--no-secure-serving"]).secure_serving


def test_without_endpoints_the_epp_follows_the_pool() -> None:
    picker, _ = settings(parse_args(["--num-endpoints", "2"]))
    assert picker is None


class Detaching(LeastInFlight):
    """Records the order of the server's calls."""

    def __init__(self, endpoints: list[str]) -> None:
        super().__init__(endpoints)
        self.calls: list[tuple[str, int]] = []

    def detached(self, stream_id: int) -> None:
        self.calls.append(("detached", stream_id))

    def finished(self, stream_id: int) -> None:
        self.calls.append(("finished", stream_id))
        super().finished(stream_id)


async def test_a_detached_stream_ends_once_routed_and_tells_the_picker_first() -> None:
    picker = Detaching([A])
    ext_proc = ExtProc(picker, detach=True)
    context: Any = None
    stream = request(b"{}", response_body=ProcessingMode.NONE)
    out = [r async for r in ext_proc.Process(messages(*stream), context)]
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    assert picker.calls[-2:] == [("detached", 1), ("finished", 1)]  # pick() finishes first too
    assert picker.in_flight == {A: 0} and ext_proc.open_streams == 0
    assert ext_proc.detached_streams == 1


async def test_a_detached_stream_is_counted_when_the_gateway_closes_at_its_last_answer() -> None:
    """Envoy may end the stream as soon as it has the answer that detaches it: the hand-over to
    the picker and the count happen before that answer goes out, not after."""
    picker = Detaching([A])
    ext_proc = ExtProc(picker, detach=True)
    context: Any = None
    responses = ext_proc.Process(messages(*request(b"{}", ProcessingMode.NONE)), context)
    out = [await anext(responses), await anext(responses)]
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    await responses.aclose()  # the gateway closes here
    assert picker.calls[-2:] == [("detached", 1), ("finished", 1)]
    assert ext_proc.detached_streams == 1 and ext_proc.open_streams == 0


async def test_where_the_gateway_streams_the_response_body_streams_stay_attached_and_it_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    picker = Detaching([A])
    ext_proc = ExtProc(picker, detach=True)
    context: Any = None
    with caplog.at_level(logging.WARNING, logger="kvrail.epp"):
        for _ in range(2):
            responses = ext_proc.Process(messages(*request(b"{}")), context)
            out = [await anext(responses), await anext(responses)]
            assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
            assert picker.in_flight == {A: 1}  # attached: booked until the stream ends
            await responses.aclose()
    assert [r.getMessage() for r in caplog.records].count(
        "not detaching: the gateway sends the response body here (response_body_mode "
        "FULL_DUPLEX_STREAMED); streams stay attached to the end of the response "
        "(docs/epp.md, 'Detaching')") == 1  # fmt: skip
    assert ("detached", 1) not in picker.calls and ext_proc.detached_streams == 0


def test_detach_is_refused_for_a_static_list_and_the_default_for_a_pool() -> None:
    with pytest.raises(ValueError, match="--detach"):
        settings(parse_args(["--endpoints", A, "--detach"]))
    assert parse_args([]).detach is None  # on for a pool where the gateway allows; off for a list
    assert parse_args(["--no-detach"]).detach is False


@pytest.mark.parametrize(
    ("host", "expected"),
    [("::", "[::]:9002"), ("0.0.0.0", "0.0.0.0:9002"), ("fd00::1", "[fd00::1]:9002"),
     ("[fd00::1]", "[fd00::1]:9002"), ("127.0.0.1", "127.0.0.1:9002")],
)  # fmt: skip
def test_the_listen_address_brackets_an_ipv6_host(host: str, expected: str) -> None:
    assert bind_address(host, 9002) == expected


class Abort(Exception):
    pass


class Context:
    """What the servicer uses of a gRPC context: abort, which raises."""

    async def abort(self, code: object, details: str) -> None:
        raise Abort(details)


def sample(ext_proc: ExtProc, name: str, labels: dict[str, str] | None = None) -> float:
    value = ext_proc.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


async def test_each_stream_is_counted_by_its_result_and_each_pick_timed() -> None:
    picker = LeastInFlight([A])
    ext_proc = ExtProc(picker, detach=True)
    context: Any = Context()
    await drain(ext_proc.Process(messages(*request(b"{}")), context))  # routed, attached
    await drain(ext_proc.Process(messages(*request(b"{}", ProcessingMode.NONE)), context))
    ext_proc_failing = ExtProc(Failing([A]))
    await drain(ext_proc_failing.Process(messages(*request(b"x")), context))  # 503
    headers_only = ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap()))
    await drain(ext_proc.Process(messages(headers_only), context))  # the client left
    early = ProcessingRequest(response_headers=HttpHeaders(headers=HeaderMap()))
    with pytest.raises(Abort, match="not expected"):  # a response before the request
        await drain(ext_proc.Process(messages(early), context))
    count = "kvrail_epp_requests_total"
    assert sample(ext_proc, count, {"result": "routed"}) == 2
    assert sample(ext_proc, count, {"result": "abandoned"}) == 1
    assert sample(ext_proc, count, {"result": "protocol_error"}) == 1
    assert sample(ext_proc_failing, count, {"result": "503"}) == 1
    assert sample(ext_proc, "kvrail_epp_detached_streams_total") == 1
    assert sample(ext_proc, "kvrail_epp_pick_seconds_count") == 2  # a pick per whole request
    assert sample(ext_proc_failing, "kvrail_epp_pick_seconds_count") == 1
    assert sample(ext_proc, "kvrail_epp_streams") == 0


async def drain(responses: AsyncIterator[Any]) -> None:
    async for _ in responses:
        pass


def test_the_metrics_are_served_over_http_with_the_routers_beside_them() -> None:
    from prometheus_client import CollectorRegistry, Counter

    ext_proc = ExtProc(LeastInFlight([A]))
    router = CollectorRegistry()
    Counter("kvrail_routing_decisions_total", "test", ["reason"], registry=router).labels(
        "prefix"
    ).inc(3)
    ext_proc.metrics.also(router)
    port = ext_proc.metrics.serve("127.0.0.1", 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert "kvrail_epp_streams 0.0" in text
    assert 'kvrail_routing_decisions_total{reason="prefix"} 3.0' in text
    with pytest.raises(RuntimeError, match=r"cannot serve metrics on 127\.0\.0\.1"):
        ExtProc(LeastInFlight([A])).metrics.serve("127.0.0.1", port)  # taken
