"""Faults under load: kill -9 and restart each component while clients keep sending requests.

`Soak` drives a `LocalPool` (real etcd, NATS, prefill and decode workers and a router, each its
own process) with a few concurrent clients, each sending greedy completions through the real
`openai` client, one after another. Before any fault it records every prompt's answer; after it,
each request ends in exactly one of these outcomes:

- `completed`: the answer, identical to the recorded one (anything else is `wrong`);
- `failed`: a clear error within the request's deadline: an OpenAI error body with a status, or
  a refused / reset connection while the router itself is down;
- `lost`: no answer and no error by the deadline plus a margin (a hang): must never happen.

A scenario either kills one component (`COMPONENTS`) with SIGKILL at a moment of load and
restarts it (same name, same port, same data directory for etcd and NATS) after `down_s`, or
injects a fault (`FAULTS`) for `fault_s`: prefill-0 restarted with transport faults (failed
writes, delayed writes, lost completion notifications; `kvrail.worker.transfer.faults`), or a
burst of extra clients (long answers that fill the KV pools; streams read slowly). The load goes
on until the end of its window, then the scenario waits for every live worker to hold no block.
It reports the outcome counts, the recovery time (from the restart, or the end of the fault,
until the first request that started after it completes) and the blocks still held after
`settle_s` (must be 0). `bench/soak/run.py` runs the scenarios for a
bounded duration and writes the figures; `tests/integration/test_faults.py` runs them briefly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import openai
from nats.aio.client import Client as NatsClient

from kvrail.bus import connect
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool

MODEL = "SmolLM2-135M-Instruct"
COMPONENTS = ("prefill", "decode", "router", "nats", "etcd")
"""Killed with SIGKILL and restarted: prefill-0, decode-0, the router, NATS, etcd."""
_TRANSPORT_FAULTS: dict[str, dict[str, str]] = {  # prefill-0 runs with these for a while
    "transfer-fail": {"KVRAIL_FAULT_FAIL_KV_WRITES": "0.5"},
    "transfer-delay": {"KVRAIL_FAULT_DELAY_KV_WRITES_S": "1.5"},
    "transfer-loss": {"KVRAIL_FAULT_LOSE_KV_NOTIFICATIONS": "0.5"},
}
_BURSTS: dict[str, tuple[int, int, float]] = {  # extra clients, max_tokens, read pause
    "kv-full": (8, 200, 0.0),  # about the KV both decode workers hold: preemption, queueing
    "slow-consumer": (2, 96, 4.0),  # streams it stops reading for 4 s after the first chunk
}
_AFTER_HEALING_S = 6.0  # load goes on at least this long after a restart or a fault's end
FAULTS = (*_TRANSPORT_FAULTS, *_BURSTS)
"""Injected for a while: transport faults at prefill-0, and bursts of load."""
_Server = TypeVar("_Server", EtcdServer, NatsServer)
_WORDS = ("river", "stone", "lamp", "orchard", "signal", "copper", "meadow", "harbor", "violet")


def prompts(count: int, num_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(num_words)) for _ in range(count)]


@dataclass
class Outcome:
    kind: str  # completed | wrong | failed | lost
    started: float
    ended: float
    detail: str = ""


@dataclass
class ScenarioResult:
    component: str
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    recovery_s: float | None = None
    blocks_leaked: int = 0
    settle_s: float = 0.0

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "component": self.component, "sent": self.sent,
            "completed": self.outcomes["completed"], "wrong": self.outcomes["wrong"],
            "failed_cleanly": self.outcomes["failed"], "lost": self.outcomes["lost"],
            "errors": dict(self.errors), "recovery_s": self.recovery_s,
            "blocks_leaked": self.blocks_leaked, "settle_s": round(self.settle_s, 2),
        }  # fmt: skip


class Soak:
    """The load and the faults. `pool` runs `prefill-0`, `decode-0`, `decode-1` and `router`
    (started by the caller, which also owns `etcd` and `nats`); the router listens on
    `router_port`."""

    def __init__(
        self,
        pool: LocalPool,
        etcd: EtcdServer,
        nats: NatsServer,
        router_port: int,
        *,
        deadline_s: float,
        max_tokens: int = 8,
        num_clients: int = 3,
        prompt_words: int = 60,
        num_prompts: int = 6,
    ) -> None:
        self.pool = pool
        self.etcd = etcd
        self.nats = nats
        self.router_port = router_port
        self.deadline_s = deadline_s
        self.max_tokens = max_tokens
        self.num_clients = num_clients
        self.prompts = prompts(num_prompts, prompt_words)
        self.expected: dict[str, str] = {}
        self._client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{router_port}/v1", api_key="unused", max_retries=0,
            timeout=deadline_s + 15.0,
        )  # fmt: skip

    async def close(self) -> None:
        await self._client.close()

    async def record_answers(self) -> None:
        """Every prompt's answer with nothing failing (the reference for `wrong`)."""
        for prompt in self.prompts:
            outcome, text = await self._ask(prompt)
            if outcome.kind != "completed":
                raise AssertionError(f"no reference answer: {outcome.kind} {outcome.detail}")
            self.expected[prompt] = text

    async def _ask(
        self, prompt: str, max_tokens: int | None = None, pause_s: float = 0.0
    ) -> tuple[Outcome, str]:
        """One completion; with `pause_s`, streamed and read slowly (a slow consumer: it stops
        reading for `pause_s` after its first chunk). A longer answer must begin with the
        recorded one (greedy decoding)."""
        started = time.monotonic()
        try:
            if pause_s:
                text = await self._read_slowly(prompt, max_tokens or self.max_tokens, pause_s)
            else:
                reply = await self._client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=max_tokens or self.max_tokens,
                    temperature=0,
                )  # fmt: skip
                text = reply.choices[0].text
        except openai.APITimeoutError:
            return Outcome("lost", started, time.monotonic(), "client timeout"), ""
        except openai.APIConnectionError as err:
            return Outcome("failed", started, time.monotonic(), f"connection: {err}"), ""
        except openai.APIStatusError as err:
            body = err.body if isinstance(err.body, dict) else {}
            code = body.get("code") or body.get("type") or "?"
            return Outcome("failed", started, time.monotonic(), f"{err.status_code} {code}"), ""
        except openai.APIError as err:  # an error event in the middle of a stream
            return Outcome("failed", started, time.monotonic(), f"stream: {err.message}"), ""
        ended = time.monotonic()
        if prompt in self.expected and not text.startswith(self.expected[prompt]):
            return Outcome("wrong", started, ended, "different text"), text
        return Outcome("completed", started, ended), text

    async def _read_slowly(self, prompt: str, max_tokens: int, pause_s: float) -> str:
        stream = await self._client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        parts: list[str] = []
        async for chunk in stream:
            if not parts:
                await asyncio.sleep(pause_s)
            parts.append(chunk.choices[0].text if chunk.choices else "")
        return "".join(parts)

    async def _load(
        self,
        stop_at: Callable[[], float],
        outcomes: list[Outcome],
        num_clients: int,
        first_client: int = 0,
        max_tokens: int | None = None,
        pause_s: float = 0.0,
    ) -> None:
        async def client(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < stop_at():
                outcome, _ = await self._ask(rng.choice(self.prompts), max_tokens, pause_s)
                outcomes.append(outcome)
                if outcome.kind == "failed":  # a client backs off a little after an error
                    await asyncio.sleep(0.2)

        clients = range(first_client, first_client + num_clients)
        await asyncio.gather(*(client(i) for i in clients))

    async def scenario(
        self,
        kind: str,
        nc_factory: Callable[[], Any],
        *,
        window_s: float,
        fault_after_s: float,
        down_s: float,
        fault_s: float = 10.0,
        settle_s: float = 60.0,
    ) -> ScenarioResult:
        """Load for `window_s` (longer if a restart takes longer). A component (`COMPONENTS`)
        is killed at `fault_after_s` and restarted `down_s` later; a fault (`FAULTS`) is on from
        `fault_after_s` (transport faults: once prefill-0 restarted with them) for `fault_s`."""
        if kind not in COMPONENTS + FAULTS:
            raise ValueError(f"unknown scenario {kind!r} (one of {COMPONENTS + FAULTS})")
        result = ScenarioResult(kind)
        outcomes: list[Outcome] = []
        started = time.monotonic()
        end = [math.inf]  # the load goes on until the healing is done (then see below)
        load = asyncio.create_task(self._load(lambda: end[0], outcomes, self.num_clients))
        await asyncio.sleep(fault_after_s)
        extra: asyncio.Task[None] | None = None
        if kind in COMPONENTS:
            await asyncio.to_thread(self._kill, kind)
            await asyncio.sleep(down_s)
        elif kind in _TRANSPORT_FAULTS:
            await asyncio.to_thread(self._restart_prefill, _TRANSPORT_FAULTS[kind])
            await asyncio.sleep(fault_s)
        else:  # a burst of load beside the steady clients, for down_s
            more, max_tokens, pause_s = _BURSTS[kind]
            burst_end = time.monotonic() + fault_s
            extra = asyncio.create_task(
                self._load(lambda: burst_end, outcomes, more, 100, max_tokens, pause_s)
            )
            await asyncio.sleep(fault_s)
        healed = time.monotonic()
        if kind in COMPONENTS:
            await asyncio.to_thread(self._restart, kind)
        elif kind in _TRANSPORT_FAULTS:
            await asyncio.to_thread(self._restart_prefill, {})
            healed = time.monotonic()  # the fault lasts until the clean worker is back
        end[0] = max(started + window_s, time.monotonic() + _AFTER_HEALING_S)
        await load
        if extra is not None:
            await extra
        for o in outcomes:
            result.outcomes[o.kind] += 1
            if o.kind != "completed":
                result.errors[o.detail.split(":")[0]] += 1
        after = sorted(o.ended for o in outcomes if o.kind == "completed" and o.started > healed)
        result.recovery_s = round(after[0] - healed, 2) if after else None
        settle_from = time.monotonic()
        nc: NatsClient = await nc_factory()
        try:
            held = await self.pool.blocks_held(nc, settle_s)
        finally:
            await nc.close()
        result.settle_s = time.monotonic() - settle_from
        # Blocks in use plus pending remote prefills; a worker holding a request counts 1 at least.
        result.blocks_leaked = sum(
            max(1, c.num_blocks - c.num_free_blocks + c.num_pending) for c in held.values()
        )
        return result

    # -- faults -----------------------------------------------------------------------------------

    def _kill(self, component: str) -> None:
        if component == "prefill":
            self.pool.kill("prefill-0")
        elif component == "decode":
            self.pool.kill("decode-0")
        elif component == "router":
            self.pool.kill("router")
        elif component == "nats":
            _kill_server(self.nats)
        elif component == "etcd":
            _kill_server(self.etcd)
        else:
            raise ValueError(f"unknown component {component!r} (one of {COMPONENTS})")

    def _restart_prefill(self, faults: dict[str, str]) -> None:
        """prefill-0 stopped cleanly (it drains), then started with `faults` in its settings."""
        self.pool.procs["prefill-0"].stop(grace_s=30)
        self.pool.start("prefill-0", "prefill", **faults)
        self.pool.wait_ready("prefill-0")

    def _restart(self, component: str) -> None:
        if component == "prefill":
            self.pool.start("prefill-0", "prefill")
            self.pool.wait_ready("prefill-0")
        elif component == "decode":
            self.pool.start("decode-0", "decode")
            self.pool.wait_ready("decode-0")
        elif component == "router":
            self.pool.start_router("router", KVRAIL_HTTP_PORT=str(self.router_port))
            self.pool.wait_ready("router")
        elif component == "nats":
            self.nats = _restarted(self.nats)
        elif component == "etcd":
            self.etcd = _restarted(self.etcd)


def _kill_server(server: EtcdServer | NatsServer) -> None:
    assert server.process is not None
    server.process.kill()
    deadline = time.monotonic() + 10
    while server.process.is_running():
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.process.name} survived kill -9")
        time.sleep(0.01)


def _restarted(server: _Server) -> _Server:
    """The same server (ports, data directory, settings) started again."""
    return dataclasses.replace(server, process=None).start()


async def run_soak(
    root: Path,
    scenarios: tuple[str, ...] = COMPONENTS + FAULTS,
    *,
    window_s: float = 40.0,
    fault_after_s: float = 10.0,
    down_s: float = 3.0,
    fault_s: float = 10.0,
    deadline_s: float = 20.0,
    settle_s: float = 60.0,
    num_clients: int = 3,
    remote_prefill_timeout_s: float = 4.0,
) -> tuple[list[ScenarioResult], dict[str, str]]:
    """Start etcd, NATS and the pool under `root`, record the answers, run the scenarios in
    order, stop everything. Returns the results and {prompt: answer}; logs stay under `root`."""
    etcd = EtcdServer(root / "etcd", root / "etcd.log").start()
    nats_server = NatsServer(root / "nats", root / "nats.log").start()
    router_port = free_port()
    env = {
        "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": "32",
        "KVRAIL_TRANSFER_CHECKSUMS": "true",
        "KVRAIL_NUM_KV_BLOCKS": "96",
        "KVRAIL_MAX_MODEL_LEN": "512",
        "KVRAIL_REQUEST_TIMEOUT_S": str(deadline_s),
        "KVRAIL_REMOTE_PREFILL_TIMEOUT_S": str(remote_prefill_timeout_s),
        # No prefix reuse between requests that do not overlap, so the same few prompts are
        # prefilled remotely every time (and zeroing on release runs under every fault).
        "KVRAIL_ZERO_KV_ON_RELEASE": "true",
    }
    pool = LocalPool(etcd, nats_server, root / "logs", f"soak-{uuid.uuid4().hex[:6]}", env)
    soak: Soak | None = None
    try:
        for worker_id, role in (("prefill-0", "prefill"), ("decode-0", "decode"),
                                ("decode-1", "decode")):  # fmt: skip
            pool.start(worker_id, role)
        for worker_id in ("prefill-0", "decode-0", "decode-1"):
            await asyncio.to_thread(pool.wait_ready, worker_id)
        pool.start_router("router", KVRAIL_HTTP_PORT=str(router_port))
        await asyncio.to_thread(pool.wait_ready, "router")
        soak = Soak(pool, etcd, nats_server, router_port, deadline_s=deadline_s,
                    num_clients=num_clients)  # fmt: skip
        await soak.record_answers()
        results = []
        for kind in scenarios:
            result = await soak.scenario(
                kind, lambda: connect(pool.settings, "soak"), window_s=window_s,
                fault_after_s=fault_after_s, down_s=down_s, fault_s=fault_s, settle_s=settle_s,
            )  # fmt: skip
            results.append(result)
        return results, dict(soak.expected)
    finally:
        if soak is not None:
            await soak.close()
            etcd, nats_server = soak.etcd, soak.nats
        pool.stop()
        nats_server.stop()
        etcd.stop()


def table(results: list[ScenarioResult]) -> str:
    """A Markdown table of the figures."""
    rows = [
        "| killed (-9) and restarted | sent | completed | failed cleanly | lost | wrong | "
        "recovery s | blocks leaked |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        d = r.as_dict()
        rows.append(
            f"| {r.component} | {d['sent']} | {d['completed']} | {d['failed_cleanly']} | "
            f"{d['lost']} | {d['wrong']} | {d['recovery_s']} | {d['blocks_leaked']} |"
        )
    return "\n".join(rows)
