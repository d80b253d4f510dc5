"""How long kvrail.epp's KV-aware picker takes to decide, with 256 endpoints (issue 48: p50 <= 1 ms,
p99 <= 3 ms on CPU).

A `KvAwarePicker` over the router's real state: the SmolLM2 tokenizer and chat template, a
`WorkerView` holding 256 ready decode workers (records and KV state fed as etcd and NATS would
deliver them; nothing is started) and the default kv-aware chooser. Each worker caches a few of
64 shared system prompts of about 1,000 tokens (and blocks of its own), so the index holds what a
busy pool's does and every decision scores real prefix matches. Each request is a chat: one of
the system prompts and a question of its own (about 1,030 tokens). Half the requests stay booked
(the load term moves), the rest finish at once.

Measured one request at a time, on the event loop, from the whole body to the pick:
- `pick`: everything the EPP does per request: the body parsed, the prompt rendered and
  tokenized (on the router's tokenizer threads), the choice and two fallbacks;
- `rank`: the choice alone, `Dispatcher.rank(job, exclude, 3)` (hashing the prompt, matching the
  index, scoring the 256 candidates once: the primary and two fallbacks), on the same prompts.

    .venv/bin/python -P bench/epp/decision.py [--requests 2000] [--endpoints 256]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import time
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from kvrail.epp.kv_picker import KvAwarePicker
from kvrail.epp.picker import PickRequest, Routed
from kvrail.keys import PoolKeys
from kvrail.messages import KvEvent, WorkerRecord
from kvrail.router.discovery.index import prompt_hashes
from kvrail.router.discovery.view import WorkerView
from kvrail.router.generate import RouterState
from kvrail.router.metrics import RouterMetrics
from kvrail.router.policy import Chooser
from kvrail.router.streams.dispatcher import Dispatcher
from kvrail.router.streams.job import Job
from kvrail.router.tenants import Admission, TenantTable
from kvrail.router.text.tokenizer import TextCodec
from kvrail.sampling import SamplingParams
from kvrail.settings import default_cache_dir

FINGERPRINT = "b" * 64
BLOCK_SIZE = 16
NUM_SYSTEM_PROMPTS = 64
WORDS = ["river", "stone", "bridge", "lantern", "orchard", "meadow", "harbor", "signal", "copper",
         "violet", "thunder", "garden", "engine", "silver", "window", "canyon"]  # fmt: skip


class _Unconnected:
    def new_inbox(self) -> str:
        return "_INBOX.bench"


def system_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(1000))


def build(
    codec: TextCodec, num_endpoints: int, rng: random.Random
) -> tuple[KvAwarePicker, list[str]]:
    keys = PoolKeys("default", "bench")
    view = WorkerView(None, None, keys)  # type: ignore[arg-type]
    view.ready.set()
    nc: Any = _Unconnected()
    dispatcher = Dispatcher(nc, keys, view, Chooser("kv-aware", rng), BLOCK_SIZE)
    state = RouterState(
        codec=codec, dispatcher=dispatcher, view=view, tenants=TenantTable(),
        admission=Admission(), metrics=RouterMetrics(), served_name="smollm2",
        max_model_len=0, request_timeout_s=60,
    )  # fmt: skip
    systems = [system_prompt(rng) for _ in range(NUM_SYSTEM_PROMPTS)]
    hashed = [
        prompt_hashes(
            codec.chat_prompt([{"role": "system", "content": s}]), BLOCK_SIZE, FINGERPRINT
        )
        for s in systems
    ]
    for i in range(num_endpoints):
        worker_id = f"decode-{i}"
        cached: list[str] = []
        for j in rng.sample(range(NUM_SYSTEM_PROMPTS), 4):
            cached += hashed[j]
        cached += [f"{rng.getrandbits(256):064x}" for _ in range(200)]  # blocks of its own
        stored = tuple(dict.fromkeys(cached))
        view.index.load_state(KvEvent(worker_id, incarnation=1, seq=0, stored=stored, cleared=True))
        view._apply_record(worker_id, WorkerRecord(
            worker_id=worker_id, pod_uid=worker_id, incarnation=1, role="decode",
            fingerprint=FINGERPRINT, block_size=BLOCK_SIZE, max_model_len=4096, is_ready=True,
            num_running=rng.randrange(8), kv_utilization=rng.random(),
            http_front=f"10.{i // 250}.{i % 250}.1:8000",
        ))  # fmt: skip
    return KvAwarePicker(state), systems


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    q = statistics.quantiles(ms, n=100)
    return {"p50_ms": round(q[49], 3), "p90_ms": round(q[89], 3), "p99_ms": round(q[98], 3),
            "max_ms": round(ms[-1], 3)}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(7)
    codec = TextCodec.load("smollm2", default_cache_dir())
    picker, systems = build(codec, args.endpoints, rng)
    if args.freeze:  # what `python -P -m kvrail.epp` does once it follows the pool
        gc.collect()
        gc.freeze()
    bodies = []
    for i in range(args.requests):
        question = f"Question {i}: " + system_prompt(rng)[:200]
        messages = [{"role": "system", "content": rng.choice(systems)},
                    {"role": "user", "content": question}]  # fmt: skip
        bodies.append(json.dumps({"model": "smollm2", "messages": messages}).encode())
    headers = {":path": "/v1/chat/completions", "content-type": "application/json"}
    pick_s: list[float] = []
    rank_s: list[float] = []
    num_prompt_tokens: list[int] = []
    for i, body in enumerate(bodies[: args.warmup] + bodies):
        started = time.perf_counter()
        result = await picker.pick(PickRequest(i, headers, body, None))
        elapsed = time.perf_counter() - started
        assert isinstance(result, Routed) and len(result.endpoints) == 3, result
        ids = tuple(codec.chat_prompt(json.loads(body)["messages"]))
        job = Job(f"b-{i}", ids, SamplingParams(max_tokens=1), 0.0)
        started = time.perf_counter()
        decisions = picker.dispatcher.rank(job, set(), 3)
        ranked = time.perf_counter() - started
        assert len(decisions) == 3
        if i % 2 == 0 or len(picker.booked) > 256:
            picker.finished(i)
        if i >= args.warmup:
            pick_s.append(elapsed)
            rank_s.append(ranked)
            num_prompt_tokens.append(len(ids))
    return {
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "endpoints": args.endpoints, "requests": args.requests, "gc_freeze": args.freeze,
        "prompt_tokens_mean": round(statistics.mean(num_prompt_tokens)),
        "index_hashes": sum(picker.state.view.index.num_hashes(w)
                            for w in picker.state.view.records()),
        "pick": percentiles(pick_s), "rank": percentiles(rank_s),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--endpoints", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--no-freeze", dest="freeze", action="store_false")
    print(json.dumps(asyncio.run(run(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
