"""The EPP's gRPC server: Envoy's ext_proc service and gRPC health, on ``grpc.aio``.

One ext_proc stream is one HTTP request. The servicer feeds the stream's messages to an
:class:`~kvrail.epp.protocol.EppStream`, awaits the picker when the request is whole, and sends
what the stream answers. Whatever ends the stream (the response's end, an ImmediateResponse, the
client leaving mid-body, a protocol error), ``Picker.finished`` runs exactly once for it, so no
booking leaks. The work per stream is bounded: the held body by ``Limits.max_body_bytes``, the rest
is echoed chunk by chunk. Logs carry stream ids, endpoints, statuses and sizes, never a body.

With ``detach``, a routed stream is closed (status OK) as soon as the request has gone back to the
gateway, which then serves the response without the EPP, if the gateway does not send the response
body here (``kvrail.epp.protocol`` says why only then); ``Picker.detached`` runs for it before
``Picker.finished``, so the picker can keep the request's booking past the stream. A stream that
cannot detach stays attached, and the first one logs why (once per process).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
    ExternalProcessorServicer,
    add_ExternalProcessorServicer_to_server,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvrail.epp.metrics import EppMetrics
from kvrail.epp.picker import NoEndpoint, Pick, Picker, PickRequest
from kvrail.epp.protocol import DEFAULT_LIMITS, EppStream, Limits, Phase, ProtocolError

log = logging.getLogger("kvrail.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: The gRPC health services the EPP protocol names (and the overall ``""``).
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)


class ExtProc(ExternalProcessorServicer):  # type: ignore[misc]
    """``envoy.service.ext_proc.v3.ExternalProcessor/Process`` speaking the EPP protocol."""

    def __init__(
        self, picker: Picker, limits: Limits = DEFAULT_LIMITS, *, detach: bool = False
    ) -> None:
        self.picker = picker
        self.limits = limits
        self.detach = detach
        self.open_streams = 0
        self.detached_streams = 0
        """Streams that ended detached (the gateway serves the rest without the EPP)."""
        self.metrics = EppMetrics(lambda: self.open_streams)
        self._ids = itertools.count(1)
        self._said_blocked = False

    async def Process(  # the gRPC method's name
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        stream = EppStream(next(self._ids), self.limits, detach=self.detach)
        self.open_streams += 1
        result = ""  # or protocol_error; else read from the stream as it ends
        try:
            async for message in requests:
                step = stream.feed(message)
                if step.pick is not None:
                    step = stream.picked(await self._pick(step.pick))
                    if stream.detach_blocked is not None and not self._said_blocked:
                        self._said_blocked = True
                        log.warning("not detaching: %s; streams stay attached to the end of "
                                    "the response (docs/epp.md, 'Detaching')",
                                    stream.detach_blocked)  # fmt: skip
                if step.served is not None:
                    self.picker.served(stream.stream_id, step.served)
                done = stream.phase is Phase.DONE
                if done and stream.detached:  # before the last answer: the gateway may close
                    self.detached_streams += 1  # the stream as soon as it has it
                    self.metrics.detached.inc()
                    self.picker.detached(stream.stream_id)
                for response in step.responses:
                    yield response
                if done:
                    return
        except ProtocolError as e:
            result = "protocol_error"
            log.warning("stream %d: protocol error: %s", stream.stream_id, e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            if result != "protocol_error":
                result = _result(stream)
            self.metrics.requests.labels(result).inc()
            self.open_streams -= 1
            self.picker.finished(stream.stream_id)
            log.debug(
                "stream %d ended in phase %s: endpoints=%s status=%s",
                stream.stream_id, stream.phase.value, ",".join(stream.endpoints) or "-",
                stream.status,
            )  # fmt: skip

    async def _pick(self, request: PickRequest) -> Pick:
        """The picker's answer; a picker that fails answers 503 rather than dropping the stream
        (which Envoy would turn into a 500 or, failing open, a request routed blind)."""
        started = time.perf_counter()
        try:
            return await self.picker.pick(request)
        except Exception as e:
            # The type only: an exception's message may quote the request, which stays out of logs.
            log.error("stream %d: the picker failed: %s", request.stream_id, type(e).__name__)
            return NoEndpoint(f"the endpoint picker failed ({type(e).__name__})")
        finally:
            self.metrics.pick.observe(time.perf_counter() - started)


def _result(stream: EppStream) -> str:
    """The ``result`` label of a stream that ended without a protocol error."""
    if stream.status is not None:  # the EPP's own refusal
        return str(stream.status)
    return "routed" if stream.endpoints else "abandoned"


@dataclasses.dataclass(frozen=True, slots=True)
class Running:
    """A started EPP: the gRPC server, its health servicer, the ext_proc servicer, the port, and
    the plaintext health server and port when there is one."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    ext_proc: ExtProc
    port: int
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None

    async def stop(self, grace_s: float) -> None:
        """Not ready first (gateways stop sending new streams), then let open streams finish."""
        for name in ("readiness", EXT_PROC_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)


def bind_address(host: str, port: int) -> str:
    """gRPC's ``host:port``, an IPv6 host in brackets: ``::`` gives ``[::]:9002``, which gRPC
    binds on both families (IPv4 alone where the host has no IPv6)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


async def start(
    picker: Picker,
    *,
    host: str,
    port: int,
    limits: Limits = DEFAULT_LIMITS,
    detach: bool = False,
    credentials: grpc.ServerCredentials | None = None,
    health_port: int | None = None,
) -> Running:
    """A started server with the ext_proc and health services (``port=0`` binds a free port);
    ``detach``: routed streams end once the request is routed (the module docstring);
    ``credentials``: TLS on that port (``kvrail.epp.tls``), else plaintext; ``health_port``: the
    health service alone, in plaintext, on a port of its own too (the kubelet's gRPC probes
    speak no TLS). Raises ``RuntimeError`` naming the address if one cannot be bound."""
    server = grpc.aio.server()
    ext_proc = ExtProc(picker, limits, detach=detach)
    add_ExternalProcessorServicer_to_server(ext_proc, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = _listen(server, host, port, credentials)
    health_server, health_bound = None, None
    if health_port is not None:
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        health_bound = _listen(health_server, host, health_port, None)
    await server.start()
    if health_server is not None:
        await health_server.start()
    for name in HEALTH_SERVICES:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Running(server, health, ext_proc, bound, health_server, health_bound)


def _listen(
    server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None
) -> int:
    address = bind_address(host, port)
    try:
        if credentials is None:
            return int(server.add_insecure_port(address))
        return int(server.add_secure_port(address, credentials))
    except RuntimeError as e:
        raise RuntimeError(f"cannot listen on {address}: {e}") from None
