"""The `kvrail` command. It starts components by module name and never imports them.

kvrail up            the local one-machine stack (what `make run` starts)
kvrail status        pools, workers and prefill queues, from etcd and NATS
kvrail model prepare convert the default model once and cache it (fast warm loads)
kvrail config        print the resolved settings (--options: every setting and its values)
kvrail version

`status` and `config` find a running local stack (`kvrail up`) on their own: with no etcd or
NATS named in the settings, they use the stack's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import aetcd
import nats.errors

from kvrail import __version__
from kvrail.errors import KvrailError
from kvrail.local.procs import ProcessFailed
from kvrail.settings import Settings, describe_settings, load_settings

log = logging.getLogger("kvrail")

PLANE_TIMEOUT_S = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrail", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, help="YAML settings file (else $KVRAIL_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the local stack (etcd, NATS, workers, router)")
    up.add_argument("--run-dir", type=Path, help="data and logs (default: <cache_dir>/run)")
    up.add_argument("--check", action="store_true", help="start, report, stop (no serving loop)")
    model = sub.add_parser("model", help="model cache")
    model.add_argument("action", choices=["prepare"])
    status = sub.add_parser("status", help="pools, workers and prefill queues")
    status.add_argument("--all-pools", action="store_true", help="every pool, not only mine")
    config = sub.add_parser("config", help="print the resolved settings")
    config.add_argument(
        "--options", action="store_true", help="every setting: default, values, meaning"
    )
    sub.add_parser("version")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = load_settings(args.config)
        if args.command == "up":
            from kvrail.local.stack import Stack

            run_dir = getattr(args, "run_dir", None) or _run_dir(settings)
            return Stack(settings, run_dir).run(check=args.check)
        if args.command == "model":
            return _prepare_model(settings)
        if args.command == "status":
            print(asyncio.run(_status(_local(settings), args.all_pools)), end="")
            return 0
        if args.command == "config" and args.options:
            print(describe_settings(), end="")
            return 0
        if args.command == "config":
            print(_local(settings).model_dump_json(indent=2))
            return 0
        print(f"kvrail {__version__}")
        return 0
    except KvrailError as err:
        print(f"kvrail: error: {err}", file=sys.stderr)
        return 2
    except ProcessFailed as err:
        print(f"kvrail: error: {err}", file=sys.stderr)
        return 1


def _run_dir(settings: Settings) -> Path:
    return settings.cache_dir / "run"


def _local(settings: Settings) -> Settings:
    """The settings, pointed at a running local stack when they name no planes of their own."""
    from kvrail.local.stack import with_stack_planes

    return with_stack_planes(settings, _run_dir(settings))


async def _status(settings: Settings, all_pools: bool) -> str:
    from kvrail.bus import connect
    from kvrail.cli.status import collect, render
    from kvrail.keys import PoolKeys
    from kvrail.local.stack import read_stack
    from kvrail.registry import etcd_client

    pool = None if all_pools else PoolKeys(settings.namespace, settings.pool)
    for name in ("nats", "nats.aio.client", "aetcd"):  # their retries are one line below
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        nc = await asyncio.wait_for(
            connect(settings, name="kvrail-status", allow_reconnect=False,
                    max_reconnect_attempts=0, connect_timeout=PLANE_TIMEOUT_S,
                    error_cb=_quiet),
            timeout=PLANE_TIMEOUT_S + 1,
        )  # fmt: skip
    except (OSError, TimeoutError, nats.errors.Error) as err:
        raise KvrailError(f"cannot reach NATS at {settings.nats_url}: {_reason(err)}") from err
    try:
        async with etcd_client(settings) as etcd:
            pools = await asyncio.wait_for(collect(etcd, nc.jetstream(), pool), PLANE_TIMEOUT_S)
    except (OSError, TimeoutError, aetcd.exceptions.ClientError) as err:
        raise KvrailError(
            f"cannot read etcd at {settings.etcd_endpoints[0]}: {_reason(err)}"
        ) from err
    finally:
        await nc.close()
    stack = read_stack(_run_dir(settings))
    expected = stack.workers if stack and stack.etcd_endpoint in settings.etcd_endpoints else ()
    return render(pools, expected_workers=expected)


async def _quiet(err: Exception) -> None:
    """NATS's own error reports: the one line `status` prints says it."""


def _reason(err: BaseException) -> str:
    """A one-line reason, also for exceptions whose text is empty (a timeout)."""
    text = str(err).strip()
    if text:
        return text.splitlines()[0]
    return "no answer within the timeout" if isinstance(err, TimeoutError) else type(err).__name__


def _prepare_model(settings: Settings) -> int:
    module = "kvrail.worker.models.loader"
    env = {**os.environ, "KVRAIL_CACHE_DIR": str(settings.cache_dir)}
    argv = [sys.executable, "-P", "-m", module, settings.model]
    return subprocess.run(argv, check=False, env=env).returncode


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
