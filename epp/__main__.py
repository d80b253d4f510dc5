"""``python -P -m kvrail.epp``: a GAIE endpoint picker over a static list of endpoints.

It serves Envoy's ext_proc service and gRPC health on ``--host:--port`` (default 0.0.0.0:9002,
the port GAIE's examples use) and picks, for each request, the endpoint of ``--endpoints`` with
the fewest requests in flight. This is not kvrail's KV-aware routing: the EPP does not yet follow
a pool's workers or their KV caches (docs/epp.md). SIGTERM: not ready, then open streams finish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kvrail.epp.picker import LeastInFlight
from kvrail.epp.protocol import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_BODY_BYTES, Limits
from kvrail.epp.server import start

log = logging.getLogger("kvrail.epp")

_GRACE_S = 30.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -P -m kvrail.epp", description=__doc__)
    parser.add_argument(
        "--endpoints", required=True, help="the endpoints to pick from: ip:port[,ip:port...]"
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9002)
    parser.add_argument(
        "--max-in-flight", type=int, default=None,
        help="requests per endpoint before the EPP sheds (429); default: no limit",
    )  # fmt: skip
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def settings(args: argparse.Namespace) -> tuple[LeastInFlight, Limits]:
    """The picker and limits the arguments describe; ``ValueError`` names the bad option."""
    if not 0 <= args.port < 65536:
        raise ValueError("--port: must be 0-65535")
    try:
        picker = LeastInFlight(args.endpoints.split(","), max_in_flight=args.max_in_flight)
    except ValueError as e:
        raise ValueError(f"--endpoints/--max-in-flight: {e}") from None
    try:
        limits = Limits(chunk_bytes=args.chunk_bytes, max_body_bytes=args.max_body_bytes)
    except ValueError as e:
        raise ValueError(f"--chunk-bytes/--max-body-bytes: {e}") from None
    return picker, limits


async def serve(args: argparse.Namespace, picker: LeastInFlight, limits: Limits) -> None:
    running = await start(picker, host=args.host, port=args.port, limits=limits)
    log.info("kvrail.epp serving ext_proc on %s:%d for %d endpoints",
             args.host, running.port, len(picker.endpoints))  # fmt: skip
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
    try:
        picker, limits = settings(args)
    except ValueError as e:
        print(f"kvrail.epp: bad settings: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(args, picker, limits))
    except RuntimeError as e:
        print(f"kvrail.epp: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
