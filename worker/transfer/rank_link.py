"""A tensor-parallel rank's KV connector, reached from rank 0 (both halves of the link).

Every rank registers its own KV shard with its own NIXL agent (NIXL registers only memory of its
own process). Rank 0's `ShardedConnector` drives ranks 1..N-1 through a socket pair per rank:
`RankTransferClient` (rank 0) sends calls, `serve_transfers` (a thread of the rank process) runs
them on the rank's `KvConnector`, one at a time, and pushes the NIXL notifications its agent
receives. Calls and results are pickled: both ends are processes of one worker, started by it.

Guarantees: a call returns the rank's result or raises `TransferError` (the rank's own error,
or "rank gone" when the link breaks: every pending call fails then, and every later one at
once). Notifications are delivered in the order the rank received them.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvrail.errors import TransferError
from kvrail.worker.transfer.kv_connector import KvConnector

log = logging.getLogger(__name__)

_POLL_S = 0.002  # how often an idle rank's transfer thread polls its agent's notifications
_METHODS = (
    "add_peer", "remove_peer", "write", "block_checksums", "transport_to",
    "write_layers", "notify", "layer_checksums",  # a layer-wise write's (docs/layerwise.md)
)  # fmt: skip


def serve_transfers(conn: Connection, connector: KvConnector, stopping: threading.Event) -> None:
    """Run rank 0's calls on `connector` until `stopping` or the link closes (a thread of the
    rank process; the connector's only caller). Closes the link when it returns, so rank 0's
    calls fail at once from then on."""
    if connector.region.tensor.is_cuda:  # the current device is per thread; kernels use it
        torch.cuda.set_device(connector.region.tensor.device)
    try:
        while not stopping.is_set():
            if conn.poll(_POLL_S):
                call_id, method, args = conn.recv()
                conn.send((call_id, *_run(connector, method, args)))
            for note in connector.notifications():
                conn.send((None, "note", note))
    except (EOFError, OSError):
        return
    finally:
        conn.close()


def _run(connector: KvConnector, method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
    if method not in _METHODS:
        return False, f"unknown method {method}"
    try:
        return True, getattr(connector, method)(*args)
    except TransferError as err:
        return False, str(err)


class RankTransferClient:
    """Rank 0's end of one rank's link. Thread-safe."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank = rank
        self._conn = conn
        self._send_lock = threading.Lock()  # one message at a time on the socket
        self._lock = threading.Lock()  # the calls in flight and the broken state
        self._ids = itertools.count()
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._notes: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self._broken: str | None = None
        self._reader = threading.Thread(target=self._read, name=f"rank{rank}-link", daemon=True)
        self._reader.start()

    def call_async(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._broken is not None:
                future.set_exception(TransferError(self._broken))
                return future
            call_id = next(self._ids)
            self._calls[call_id] = future
        try:
            with self._send_lock:
                self._conn.send((call_id, method, args))
        except OSError as err:
            self._fail(f"rank {self.rank} is gone: {type(err).__name__}")
        return future

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        try:
            return self.call_async(method, *args).result(timeout_s)
        except concurrent.futures.TimeoutError as err:
            raise TransferError(f"rank {self.rank} did not answer {method} in time") from err

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while True:
            try:
                out.append(self._notes.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._fail(f"rank {self.rank}'s link is closed")
        self._conn.close()

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                self._fail(f"rank {self.rank} is gone")
                return
            if call_id is None:  # a notification pushed by the rank
                self._notes.put(value)
                continue
            with self._lock:
                future = self._calls.pop(call_id, None)
            if future is None:
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(TransferError(f"rank {self.rank}: {value}"))

    def _fail(self, reason: str) -> None:
        with self._lock:
            self._broken = self._broken or reason
            calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(TransferError(reason))
