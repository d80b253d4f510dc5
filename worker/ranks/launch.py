"""Rank 0's side of a tensor-parallel worker: start ranks 1..N-1, drive them, notice when one dies.

`RankSet.start` hosts the group's rendezvous store on loopback, starts each rank as its own
process (`python -P -m kvrail.worker.ranks`, inheriting stdout and stderr, so its log lines land
in the worker's log) with three descriptors: a command socket (its `RankSpec`, then the engine's
`RankCommand`s; `Started`, `Ready` or `Failed` back), a transfer socket (`rank_link.py`) and a
lifeline pipe whose write end only rank 0 holds, so a rank exits as soon as rank 0's process is
gone, however it died. A thread per rank waits for its process; when one exits while the set is
open, the set is `lost` for good: `send` raises `RankLostError`, a blocked collective is aborted
(`TpGroup.abort`; gloo raises on its own) and every `on_lost` callback runs, once.

`RankSet` is the engine's `RankPeers`. `close()` stops every rank (a `Stop`, then SIGKILL after
a grace period), idempotent; nothing it started outlives it.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from kvrail.errors import RankLostError
from kvrail.worker.engine.rank_commands import RankCommand, Stop
from kvrail.worker.parallel.group import TpGroup
from kvrail.worker.ranks.spec import Failed, RankSpec, Ready, Started
from kvrail.worker.transfer.rank_link import RankTransferClient

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""How long a rank may take to load its shard (a 70B model's shard from a slow disk)."""
_STOP_GRACE_S = 10.0


def rank_agent_name(agent_name: str, rank: int) -> str:
    """Rank `rank`'s NIXL agent in a worker whose rank 0 is `agent_name`."""
    return agent_name if rank == 0 else f"{agent_name}-rank{rank}"


OnLost = Callable[[int, int | None], None]
"""(rank, exit code or None), called on the rank's watcher thread."""


@dataclass(slots=True)
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    commands: Connection
    transfers: Connection
    lifeline: int
    ready: Ready | None = None


class RankSet:
    def __init__(self, size: int, store: Any, ranks: list[_Rank]) -> None:
        self.size = size
        self.store = store
        self._ranks = ranks
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one command at a time on every socket
        self._closing = False
        self.lost: tuple[int, int | None] | None = None
        self._on_lost: list[OnLost] = []
        self._group: TpGroup | None = None
        self._watchers = [
            threading.Thread(target=self._watch, args=(r,), name=f"rank{r.rank}-watch", daemon=True)
            for r in ranks
        ]
        for watcher in self._watchers:
            watcher.start()

    @classmethod
    def start(cls, template: RankSpec, size: int) -> RankSet:
        """Start ranks 1..size-1 from `template` (its rank, size and store port are filled in
        per rank) and return at once; they load while rank 0 does (`wait_ready`)."""
        store = TCPStore(
            "127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=template.collective_timeout_s),
        )  # fmt: skip
        ranks: list[_Rank] = []
        try:
            for rank in range(1, size):
                agent = rank_agent_name(template.agent_name, rank) if template.agent_name else None
                spec = replace(
                    template, rank=rank, size=size, store_port=store.port, agent_name=agent
                )
                ranks.append(_spawn(spec))
        except BaseException:
            for r in ranks:
                _kill(r)
            raise
        log.info(
            "tensor parallel ranks started size=%d pids=%s",
            size, ",".join(str(r.proc.pid) for r in ranks),
        )  # fmt: skip
        return cls(size, store, ranks)

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]

    def on_lost(self, callback: OnLost) -> None:
        with self._lock:
            lost = self.lost
            self._on_lost.append(callback)
        if lost is not None:
            callback(*lost)

    def attach(self, group: TpGroup) -> None:
        """The group to abort when a rank is lost (so a collective blocked on it raises)."""
        self._group = group

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> list[Ready]:
        """Wait for every rank's `Ready`; raises RankLostError when one failed or died first."""
        deadline = time.monotonic() + timeout_s
        for r in self._ranks:
            while r.ready is None:
                self._check_lost()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RankLostError(f"rank {r.rank} was not ready within {timeout_s:.0f}s")
                try:
                    if not r.commands.poll(min(remaining, 0.5)):
                        continue
                    message = r.commands.recv()
                except (EOFError, OSError) as err:
                    raise RankLostError(f"rank {r.rank} died while starting") from err
                if isinstance(message, Failed):
                    raise RankLostError(f"rank {r.rank} could not start: {message.reason}")
                if isinstance(message, Ready):
                    r.ready = message
                elif not isinstance(message, Started):
                    raise RankLostError(f"rank {r.rank} said {type(message).__name__}")
        return self.readies

    @property
    def readies(self) -> list[Ready]:
        """Each rank's `Ready`, rank order (complete after `wait_ready`)."""
        return [r.ready for r in self._ranks if r.ready is not None]

    def transfer_clients(self) -> list[RankTransferClient]:
        return [RankTransferClient(r.rank, r.transfers) for r in self._ranks]

    def send(self, command: RankCommand) -> None:
        """`RankPeers.send`: to every rank, in order; RankLostError once a rank is gone."""
        self._check_lost()
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            for r in self._ranks:
                try:
                    r.commands.send_bytes(payload)
                except OSError as err:
                    self._lose(r.rank, r.proc.poll())
                    raise RankLostError(f"rank {r.rank} is gone") from err

    def _check_lost(self) -> None:
        if self.lost is not None:
            rank, code = self.lost
            raise RankLostError(f"rank {rank} is gone (exit code {code})")

    def _watch(self, r: _Rank) -> None:
        code = r.proc.wait()
        if not self._closing:
            self._lose(r.rank, code)

    def _lose(self, rank: int, code: int | None) -> None:
        with self._lock:
            if self.lost is not None or self._closing:
                return
            self.lost = (rank, code)
            callbacks = list(self._on_lost)
        log.error("tensor parallel rank lost rank=%d exit_code=%s", rank, code)
        if self._group is not None:
            self._group.abort()
        for callback in callbacks:
            callback(rank, code)

    def close(self) -> None:
        """Stop every rank and reap it (SIGKILL after a grace period). Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        payload = pickle.dumps(Stop())
        with self._send_lock:
            for r in self._ranks:
                try:
                    r.commands.send_bytes(payload)
                except OSError:
                    pass
        deadline = time.monotonic() + _STOP_GRACE_S
        for r in self._ranks:
            try:
                r.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("rank did not stop; killing it rank=%d", r.rank)
            _kill(r)
        log.info("tensor parallel ranks stopped size=%d", self.size)


def _spawn(spec: RankSpec) -> _Rank:
    parent_cmd, child_cmd = socket.socketpair()
    parent_xfer, child_xfer = socket.socketpair()
    life_read, life_write = os.pipe()
    fds = (child_cmd.fileno(), child_xfer.fileno(), life_read)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "kvrail.worker.ranks",
             "--commands", str(fds[0]), "--transfers", str(fds[1]), "--lifeline", str(fds[2])],
            pass_fds=fds, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        child_cmd.close()
        child_xfer.close()
        os.close(life_read)
    r = _Rank(spec.rank, proc, _connection(parent_cmd), _connection(parent_xfer), life_write)
    r.commands.send(spec)
    return r


def _connection(sock: socket.socket) -> Connection:
    return Connection(sock.detach())


def _kill(r: _Rank) -> None:
    if r.proc.poll() is None:
        r.proc.kill()
    r.proc.wait()
    for closing in (r.commands.close, r.transfers.close, lambda: os.close(r.lifeline)):
        try:
            closing()
        except OSError:
            pass
