"""``python -P -m kvrail.epp``: a GAIE endpoint picker for a kvrail pool, or a static list.

It serves Envoy's ext_proc service and gRPC health on ``--host:--port`` (default [::]:9002, the
port GAIE's examples use), over TLS unless ``--no-secure-serving`` (``kvrail.epp.tls``), gRPC
health alone in plaintext on ``--health-port`` (9003) for the kubelet's probes, and Prometheus
metrics on ``--metrics-port`` (9090). Without ``--endpoints`` it follows the kvrail pool its
settings name (``KVRAIL_*``, as the pool's routers read them) and picks, for each request, the
worker kvrail's router would choose, naming that worker's HTTP front (``kvrail.epp.kv_picker``).
With ``--endpoints`` it picks the endpoint of that list with the fewest requests in flight and
never reads the prompt. SIGTERM: not ready, then open streams finish.

For a kvrail pool the EPP detaches by default (``--no-detach`` turns it off): each ext_proc
stream ends once its request is routed, so a killed or restarted EPP loses no routed request,
but only behind a gateway that does not send the response body to the EPP
(``response_body_mode: NONE``, which Envoy reports on each stream); behind one that streams it
(``FULL_DUPLEX_STREAMED``) a close could lose response bytes, so there streams stay attached and
the first logs why (``kvrail.epp.protocol``; docs/epp.md, "Detaching"). An attached stream
follows the response (the served endpoint read back; to the response's end where the gateway
sends its body here, bookings ended with it); SIGTERM lets open streams finish, so a rolling
restart loses none, but a killed EPP breaks them. A static list never detaches: its only load
signal is its streams.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from kvrail.epp.kv_picker import KvAwarePicker
from kvrail.epp.picker import LeastInFlight, Picker
from kvrail.epp.pool import follow_pool
from kvrail.epp.protocol import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_BODY_BYTES, Limits
from kvrail.epp.server import start
from kvrail.epp.tls import server_credentials
from kvrail.errors import ConfigError, KvrailError
from kvrail.router.generate import RouterState
from kvrail.settings import Settings, load_settings

log = logging.getLogger("kvrail.epp")

_GRACE_S = 30.0
METRICS_REFRESH_S = 5.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -P -m kvrail.epp", description=__doc__)
    parser.add_argument(
        "--endpoints", default=None,
        help="a static list to pick from by load alone: ip:port[,ip:port...]; default: the "
        "HTTP fronts of the kvrail pool the settings name, picked as its router picks",
    )  # fmt: skip
    parser.add_argument(
        "--num-endpoints", type=int, default=1,
        help="kvrail pool: the endpoints named per request, the primary then fallbacks; more "
        "than 1 only for a gateway that takes a list (an ORIGINAL_DST cluster does not)",
    )  # fmt: skip
    parser.add_argument(
        "--host", default="::",
        help="default ::, every address of both families (IPv4 alone on a host without IPv6)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=9002)
    parser.add_argument(
        "--secure-serving", action=argparse.BooleanOptionalAction, default=True,
        help="TLS on --port, as GAIE's gateways expect of a picker (default; they do not verify "
        "its certificate); --no-secure-serving: plaintext",
    )  # fmt: skip
    parser.add_argument(
        "--cert-path", type=Path, default=None,
        help="a directory with tls.crt and tls.key (e.g. a mounted kubernetes.io/tls Secret), "
        "re-read when they change; default: a self-signed certificate made at start-up",
    )  # fmt: skip
    parser.add_argument(
        "--health-port", type=int, default=9003,
        help="gRPC health alone, in plaintext, for the kubelet's probes (default 9003, as GAIE's "
        "picker); the health service is on --port too",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-port", type=int, default=9090,
        help="Prometheus metrics over HTTP (/metrics) on --host:this port (default 9090, as "
        "GAIE's EPPs); 0: a free port, logged",
    )  # fmt: skip
    parser.add_argument(
        "--max-in-flight", type=int, default=None,
        help="static list: requests per endpoint before the EPP sheds (429); default: no limit",
    )  # fmt: skip
    parser.add_argument(
        "--detach", action=argparse.BooleanOptionalAction, default=None,
        help="end each ext_proc stream once its request is routed, so the response bypasses "
        "the EPP, where the gateway sends no response body here; default: on for a kvrail "
        "pool, refused with --endpoints",
    )  # fmt: skip
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def settings(args: argparse.Namespace) -> tuple[LeastInFlight | None, Limits]:
    """The static picker (None: follow the kvrail pool) and the limits the arguments describe;
    ``ValueError`` names the bad option."""
    ports = (("--port", args.port), ("--health-port", args.health_port),
             ("--metrics-port", args.metrics_port))  # fmt: skip
    for name, port in ports:
        if not 0 <= port < 65536:
            raise ValueError(f"{name}: must be 0-65535")
    taken = [p for _, p in ports if p]
    if len(set(taken)) != len(taken):
        raise ValueError("--port, --health-port, --metrics-port: must differ (or be 0: free ports)")
    if args.cert_path is not None and not args.secure_serving:
        raise ValueError("--cert-path: not with --no-secure-serving")
    if args.num_endpoints < 1:
        raise ValueError("--num-endpoints: must be at least 1")
    picker = None
    if args.endpoints is not None:
        try:
            picker = LeastInFlight(args.endpoints.split(","), max_in_flight=args.max_in_flight)
        except ValueError as e:
            raise ValueError(f"--endpoints/--max-in-flight: {e}") from None
        if args.detach:
            raise ValueError("--detach: not with --endpoints (a static list's load is its streams)")
    elif args.max_in_flight is not None:
        raise ValueError("--max-in-flight: only with --endpoints")
    try:
        limits = Limits(chunk_bytes=args.chunk_bytes, max_body_bytes=args.max_body_bytes)
    except ValueError as e:
        raise ValueError(f"--chunk-bytes/--max-body-bytes: {e}") from None
    return picker, limits


async def serve(
    args: argparse.Namespace,
    static: LeastInFlight | None,
    limits: Limits,
    pool: Settings | None,
    credentials: grpc.ServerCredentials | None,
) -> None:
    """Serve until SIGTERM; ``credentials``: TLS on the ext_proc port (None: plaintext)."""
    if static is not None:
        what = f"{len(static.endpoints)} static endpoints"
        await _serve(args, static, limits, credentials, what, None)
        return
    assert pool is not None
    async with follow_pool(pool) as state:
        picker = KvAwarePicker(state, num_endpoints=args.num_endpoints)
        gc.collect()  # what was loaded stays: out of the collector's sight, as in the router
        gc.freeze()
        what = f"pool {pool.namespace}/{pool.pool}"
        refresh = asyncio.create_task(_refresh_worker_gauges(state))
        try:
            await _serve(args, picker, limits, credentials, what, state.metrics.registry)
        finally:
            refresh.cancel()


async def _refresh_worker_gauges(state: RouterState) -> None:
    """The router's per-worker gauges, set from the view every `METRICS_REFRESH_S` (the router
    sets them as it renders a scrape; here the scrape runs on the metrics server's thread, which
    must not read the view)."""
    while True:
        state.metrics.refresh(state.view, state.dispatcher.in_flight)
        await asyncio.sleep(METRICS_REFRESH_S)


async def _serve(
    args: argparse.Namespace,
    picker: Picker,
    limits: Limits,
    credentials: grpc.ServerCredentials | None,
    what: str,
    router_metrics: CollectorRegistry | None,
) -> None:
    detach = args.detach is not False and not isinstance(picker, LeastInFlight)
    running = await start(
        picker, host=args.host, port=args.port, limits=limits, detach=detach,
        credentials=credentials, health_port=args.health_port,
    )  # fmt: skip
    metrics = running.ext_proc.metrics
    if router_metrics is not None:
        metrics.also(router_metrics)
    try:
        metrics_port = metrics.serve(args.host, args.metrics_port)
    except RuntimeError:
        await running.stop(0)
        raise
    log.info(
        "kvrail.epp serving ext_proc on %s:%d (%s) for %s detach=%s, health on port %s, "
        "metrics on port %d",
        args.host, running.port, "TLS" if credentials else "plaintext", what, detach,
        running.health_port, metrics_port,
    )  # fmt: skip
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("kvrail.epp stopping")
    await running.stop(_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")  # fmt: skip
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the router (its main says why)
    try:
        picker, limits = settings(args)
        pool = load_settings() if picker is None else None
        credentials = server_credentials(args.cert_path) if args.secure_serving else None
    except (ValueError, ConfigError) as e:
        print(f"kvrail.epp: bad settings: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(args, picker, limits, pool, credentials))
    except (RuntimeError, KvrailError) as e:
        print(f"kvrail.epp: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
