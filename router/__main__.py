"""`python -P -m kvrail.router`: the OpenAI-compatible router of one pool.

Settings come from the environment (and `KVRAIL_CONFIG`) alone: in a cluster the operator writes
the pool's settings into the router's environment as it does the workers'. The router loads the
model's tokenizer (never its weights), follows the pool's workers in etcd and their KV events on
NATS, and serves HTTP on `router_host:http_port` (default 127.0.0.1:8000) until SIGTERM, when it
stops taking connections and lets requests in flight finish (bounded by `_GRACE_S`). Workers of a
vLLM pool (`engine: vllm` records) are reached over HTTP with one shared client.

`--pin-worker ID` makes it one decode worker's HTTP front: every request goes to that worker
(a remote prefill still through the pool's prefill queue), `/ready` and the context length are
that worker's. The worker advertises the front (`--http-front`) for Gateway API endpoint
pickers (`kvrail.epp`, docs/epp.md).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import random
import sys

import httpx
import uvicorn
import uvloop

from kvrail.bus import connect
from kvrail.errors import ConfigError, KvrailError
from kvrail.keys import PoolKeys, check_label
from kvrail.model_files import resolve
from kvrail.registry import Registry, etcd_client
from kvrail.router.api.sampling import Defaults
from kvrail.router.app import RouterState, create_app
from kvrail.router.discovery.view import WorkerView
from kvrail.router.metrics import RouterMetrics
from kvrail.router.output import detect
from kvrail.router.policy import Chooser, WeightedScorer
from kvrail.router.streams.dispatcher import Dispatcher
from kvrail.router.streams.vllm_options import VllmOptions
from kvrail.router.tenants import Admission, TenantTable
from kvrail.router.text.chat_template import template_file
from kvrail.router.text.tokenizer import TextCodec
from kvrail.settings import Settings, format_scorers, load_settings

log = logging.getLogger("kvrail.router")

DEFAULT_PORT = 8000
_GRACE_S = 30
# One HTTP client for every request to the pool's vLLM servers: connections are reused, and the
# pool is far larger than any server's concurrency so the router never queues requests itself.
_HTTP_LIMITS = httpx.Limits(max_connections=4096, max_keepalive_connections=512)


def chooser(settings: Settings) -> Chooser:
    """The routing policy the settings name, with their scorers' weights where they give any;
    raises ConfigError for an invalid profile."""
    scorers = [WeightedScorer(s.name, s.weight) for s in settings.router_scorers]
    return Chooser(settings.router_policy, random.Random(), scorers=scorers or None)


async def serve(settings: Settings, pin_worker: str = "") -> None:
    policy = chooser(settings)  # before anything loads: a bad profile fails at once
    tenants = TenantTable.load(settings.api_keys_file)
    template = None
    if settings.chat_template is not None:
        template = template_file(settings.chat_template)
    log.info("loading the tokenizer model=%s", settings.model)
    codec = await asyncio.to_thread(TextCodec.load, settings.model, settings.cache_dir, template)
    defaults = Defaults.of(settings.generation_config, resolve(settings.model).generation_config())
    served_name = settings.served_model_name or codec.served_name
    keys = PoolKeys(settings.namespace, settings.pool)
    nc = await connect(settings, name=f"kvrail-router-{settings.pod_name or 'local'}")
    etcd = etcd_client(settings)
    view = WorkerView(Registry(etcd, keys), nc, keys)
    await view.start()
    metrics = RouterMetrics()
    # trust_env=False: a proxy set in the environment must not carry in-pool traffic. Each request
    # sets its own timeouts from its deadline.
    http = httpx.AsyncClient(limits=_HTTP_LIMITS, trust_env=False, timeout=None)
    vllm = VllmOptions(
        http, served_name, settings.min_remote_prefill_tokens, settings.kv_load_failure_policy,
        settings.remote_prefill_timeout_s, on_prefill_failure=metrics.prefill_failure,
    )  # fmt: skip
    dispatcher = Dispatcher(
        nc, keys, view, policy, settings.block_size,
        max_attempts=settings.router_max_attempts, on_decision=metrics.decision, vllm=vllm,
        pin_worker=pin_worker,
    )  # fmt: skip
    state = RouterState(
        codec=codec, dispatcher=dispatcher, view=view, tenants=tenants, admission=Admission(),
        metrics=metrics, served_name=served_name, max_model_len=settings.max_model_len or 0,
        request_timeout_s=settings.request_timeout_s, defaults=defaults,
        allow_special_tokens=settings.allow_special_tokens_in_prompts,
        max_choices=settings.max_choices,
        tool_call_parser=detect.tool_parser(settings.tool_call_parser, codec.chat_template),
        reasoning_parser=detect.reasoning_parser(settings.reasoning_parser, codec.chat_template),
    )  # fmt: skip
    gc.collect()  # what was loaded stays: out of the collector's sight (see the worker's main)
    gc.freeze()
    port = settings.http_port or DEFAULT_PORT
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(state),
            host=settings.router_host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=_GRACE_S,
            access_log=False,
            # Nothing reads a client's address (X-Forwarded-For), and no response names the
            # server software: two steps fewer per request.
            proxy_headers=False,
            server_header=False,
        )
    )
    try:
        await asyncio.wait_for(view.ready.wait(), timeout=30)
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():  # noqa: ASYNC110 (uvicorn sets a flag)
            await asyncio.sleep(0.05)
        if server.started:
            log.info(
                "router ready url=http://%s:%d model=%s policy=%s scorers=%s pool=%s/%s tenants=%s "
                "sampling_defaults=%s tool_call_parser=%s reasoning_parser=%s pin_worker=%s",
                settings.router_host, port, served_name, settings.router_policy,
                format_scorers(settings.router_scorers) or "default", keys.namespace,
                keys.pool, "on" if tenants.enabled else "off",
                ",".join(f"{k}:{v}" for k, v in defaults.describe().items()),
                state.tool_call_parser, "think" if state.reasoning_parser else "none",
                pin_worker or "-",
            )  # fmt: skip
        await serving
        if not server.started:
            raise KvrailError(f"cannot listen on {settings.router_host}:{port}")
    finally:
        await view.stop()
        await http.aclose()
        await nc.drain()
        await etcd.close()
        log.info("router stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P -m kvrail.router")
    parser.add_argument(
        "--pin-worker", default="", metavar="WORKER_ID",
        help="serve as that decode worker's HTTP front: send every request to it and no other "
        "(a Gateway API endpoint, docs/epp.md); remote prefill still goes through the pool",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        if args.pin_worker:
            check_label("--pin-worker", args.pin_worker)
    except (ConfigError, ValueError) as err:
        print(f"kvrail router: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    # One prompt per tokenizer thread, never one prompt over several threads: `tokenizers` would
    # otherwise hand even a one-text batch to its Rayon pool, whose threads wake, spin and yield
    # for every request on the cores the event loop needs (on the router bench: 7 sched_yield and
    # 8 more futex calls per streamed request, `bench/router/README.md`). An operator's own
    # setting is kept.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        # uvloop: HTTP and NATS share this one loop, and its per-event cost is the router's.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(settings, args.pin_worker))
    except KvrailError as err:
        print(f"kvrail router: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
