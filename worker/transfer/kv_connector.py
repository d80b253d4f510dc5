"""The KV connector: writes blocks into a peer's KV region, one NIXL agent per worker.

The whole KV region is registered with NIXL once.

Agent names carry the worker's incarnation (`<worker_id>-<incarnation>`), so a restarted peer is
a different agent and a write can never land in the memory of the process it replaced. Writes are
NIXL WRITE operations over UCX with the completion notification attached; on CPU UCX moves DRAM to
DRAM (shared memory or CMA between processes), across nodes over RDMA when the fabric has it.

Between two GPU processes on one node the data goes over CUDA IPC instead (`cuda_ipc.py`: the
peer's region is mapped once and blocks are copied device to device: a few runs one copy each,
many scattered blocks by one kernel replayed from a CUDA graph, `ipc_copy.py`), and only the
completion notification uses NIXL. Those copies and the checksums' reads run on the connector's
own CUDA stream: on the default one they queued behind whatever the engine launched since (a
prefill worker computes its next prompt while it writes the last one's blocks). Nothing needs to
wait for the engine's stream: blocks are handed over after the step that wrote them has been
read back (its first token).

Which path a peer gets is decided when it is added and reported by
`transport_to(peer)` and in every `TransferStats`; a failed IPC mapping falls back to NIXL with a
warning, never silently.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvrail.errors import TransferError
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.transfer.blocks import TransferStats, checked_ids, coalesce, count_runs
from kvrail.worker.transfer.cuda_ipc import ImportedRegion, export_region
from kvrail.worker.transfer.envelope import block_checksums
from kvrail.worker.transfer.ipc_copy import GraphedBlockCopy
from kvrail.worker.transfer.layer_groups import layer_checksums

log = logging.getLogger(__name__)

# Up to this many contiguous runs are copied with one copy each; more go through one kernel.
_MAX_COPY_CALLS = 4


def _nixl() -> Any:
    """The NIXL module: the `nixl` meta package where installed, else the CUDA 12 wheel."""
    try:
        import nixl._api as api
    except ImportError:
        import nixl_cu12._api as api
    return api


def _nixl_errors() -> tuple[type[Exception], ...]:
    """The exception classes NIXL's bindings raise (nixlRemoteDisconnectError and others)."""
    bind = _nixl().nixlBind
    return tuple(
        e for n in dir(bind) if n.startswith("nixl") and isinstance(e := getattr(bind, n), type)
        and issubclass(e, Exception)
    )  # fmt: skip


@dataclass(slots=True)
class _Peer:
    base_address: int
    num_blocks: int
    device_id: int
    ipc: ImportedRegion | None = None
    copier: GraphedBlockCopy | None = None  # into `ipc`, made by the first scattered write


def _frame(header: dict[str, object], agent_metadata: bytes) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<I", len(head)) + head + agent_metadata


def _unframe(blob: bytes) -> tuple[dict[str, object], bytes]:
    try:
        (n,) = struct.unpack_from("<I", blob)
        header = json.loads(blob[4 : 4 + n])
    except (struct.error, ValueError) as err:
        raise TransferError("peer metadata is malformed") from err
    if not isinstance(header, dict):
        raise TransferError("peer metadata is malformed")
    return header, blob[4 + n :]


class KvConnector:
    """One worker's end of every KV transfer. Not thread-safe: one owner calls it.

    Guarantees:
    - `write()` returns only after every byte landed in the peer's region, or raises
      `TransferError`; the notification is delivered to the peer only after a complete write.
    - A peer removed with `remove_peer()` is never written to again; a write to an unknown peer
      raises `TransferError` at once.
    - Block ids are checked against both regions before anything moves (no partial effect).
    - The transport a write used is the one reported: `transport_to(peer)` before, the
      `TransferStats` after (`cuda-ipc` or `nixl-ucx`).
    """

    transport = "nixl-ucx"
    """The path to a peer that is not on CUDA IPC (what the worker's record reports)."""
    supports_layers = True
    """`write_layers`, `notify` and `layer_checksums` work (docs/layerwise.md)."""

    def __init__(self, agent_name: str, region: KVCache, *, prefer_ipc: bool = True) -> None:
        api = _nixl()
        self.prefer_ipc = prefer_ipc
        self.agent_name = agent_name
        self.region = region
        # NIXL's progress thread polls with a zero timeout: on CPU it keeps a core busy even when
        # idle (bench/studies/routing/idle_cpu.json: 1.01 cores per idle worker, 0.012 without), and
        # both sides progress UCX themselves there (the writer polls its transfer, the reader its
        # notifications). On the GPU it stays: without it, NIXL's default UCX path moved a 1 GiB
        # handoff on the H200 at 1.07 TB/s, with it at 1.74 TB/s (same session:
        # bench/history/transfer/results-h200-no-progress-thread.json against
        # bench/transfer/results-h200-rerun.json; kvrail's CUDA IPC path, 2.0 TB/s, does not use
        # it).
        progress_thread = region.tensor.is_cuda
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self._agent = api.nixl_agent(agent_name, config)
        self._reg = self._agent.register_memory(region.tensor)
        self._mem = "VRAM" if region.tensor.is_cuda else "DRAM"
        self._peers: dict[str, _Peer] = {}
        self._stream = torch.cuda.Stream(region.tensor.device) if region.tensor.is_cuda else None

    @property
    def block_bytes(self) -> int:
        return self.region.block_bytes

    def block_checksums(self, block_ids: Sequence[int]) -> tuple[str, ...]:
        """The checksums of these blocks of the region (`envelope.block_checksums`)."""
        with self._own_stream():
            return block_checksums(self.region, block_ids)

    def _own_stream(self) -> contextlib.AbstractContextManager[object]:
        """Run what follows on the connector's stream (see the module's docstring)."""
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def rank_metadata(self) -> tuple[bytes, ...]:
        return ()

    def metadata(self) -> bytes:
        """NIXL agent metadata framed with the region's address and geometry."""
        header = {
            "agent": self.agent_name, "base": self.region.base_address,
            "num_blocks": self.region.num_blocks, "block_bytes": self.region.block_bytes,
            "mem": self._mem, "device": self.region.device_id, "host": socket.gethostname(),
        }  # fmt: skip
        if self.region.tensor.is_cuda:
            header["ipc"] = export_region(self.region.tensor).hex()
        return _frame(header, bytes(self._agent.get_agent_metadata()))

    def transport_to(self, peer: str) -> str:
        remote = self._peers.get(peer)
        if remote is None:
            raise TransferError(f"unknown or removed peer {peer}")
        return "cuda-ipc" if remote.ipc is not None else self.transport

    def add_peer(self, metadata: bytes, rank_metadata: Sequence[bytes] = ()) -> str:
        """Load a peer from its `metadata()`; returns its agent name. Refuses a peer whose
        blocks differ in size or memory kind, or one of several ranks (`rank_metadata`): it
        cannot share our fingerprint."""
        if rank_metadata:
            raise TransferError(
                f"peer runs {len(rank_metadata) + 1} tensor-parallel ranks, this worker one"
            )
        header, agent_metadata = _unframe(metadata)
        try:
            name, base = str(header["agent"]), int(header["base"])  # type: ignore[call-overload]
            num_blocks = int(header["num_blocks"])  # type: ignore[call-overload]
            block_bytes = int(header["block_bytes"])  # type: ignore[call-overload]
            device = int(header["device"])  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError) as err:
            raise TransferError("peer metadata lacks the region description") from err
        if block_bytes != self.region.block_bytes or header.get("mem") != self._mem:
            raise TransferError(
                f"peer {name} has {block_bytes}-byte {header.get('mem')} blocks, we have "
                f"{self.region.block_bytes}-byte {self._mem} blocks"
            )
        loaded = self._agent.add_remote_agent(agent_metadata)
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != name:
            self._agent.remove_remote_agent(loaded_name)
            raise TransferError(f"peer metadata names agent {loaded_name}, header says {name}")
        self._peers[name] = _Peer(base, num_blocks, device, self._open_ipc(name, header))
        log.info(
            "peer added agent=%s peer=%s blocks=%d transport=%s",
            self.agent_name, name, num_blocks, self.transport_to(name),
        )  # fmt: skip
        return name

    def _open_ipc(self, name: str, header: dict[str, object]) -> ImportedRegion | None:
        ipc = header.get("ipc")
        if not (self.prefer_ipc and self.region.tensor.is_cuda and isinstance(ipc, str)):
            return None
        if header.get("host") != socket.gethostname():
            return None
        try:
            return ImportedRegion(bytes.fromhex(ipc), self.region.tensor.device)
        except (TransferError, ValueError, RuntimeError) as err:
            log.warning("CUDA IPC unavailable, using NIXL peer=%s error=%s", name, err)
            return None

    def remove_peer(self, agent_name: str) -> None:
        remote = self._peers.pop(agent_name, None)
        if remote is not None:
            if remote.copier is not None:  # its graphs hold the mapping's addresses
                remote.copier.close()
            if remote.ipc is not None:
                remote.ipc.close()
            self._agent.remove_remote_agent(agent_name)
            log.info("nixl peer removed agent=%s peer=%s", self.agent_name, agent_name)

    def write(
        self,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        notification: bytes,
        deadline_s: float,
    ) -> TransferStats:
        remote, src_ids, dst_ids = self._endpoints(peer, src_block_ids, dst_block_ids)
        if remote.ipc is not None:
            return self._write_ipc(peer, remote, src_ids, dst_ids, notification)
        runs = coalesce(src_ids, dst_ids)
        size = self.region.block_bytes
        base, dev = self.region.base_address, self.region.device_id
        src = [(base + s * size, n * size, dev) for s, _, n in runs]
        dst = [(remote.base_address + d * size, n * size, remote.device_id) for _, d, n in runs]
        seconds = self._nixl_write(peer, src, dst, notification, deadline_s)
        return TransferStats(len(src_block_ids) * size, seconds, self.transport)

    def write_layers(
        self,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layers: tuple[int, int],
        deadline_s: float,
        ready: Any = None,
    ) -> TransferStats:
        """Write layers `[a, b)` of the blocks (one group of a layer-wise transfer,
        docs/layerwise.md), with no notification; returns once they landed. `ready`: an event
        recorded after the engine wrote those layers, waited for here, never by the engine."""
        remote, src_ids, dst_ids = self._endpoints(peer, src_block_ids, dst_block_ids)
        num_layers, (first, end) = self.region.num_layers, layers
        if not 0 <= first < end <= num_layers:
            raise TransferError(f"layers [{first}, {end}) outside the model's {num_layers}")
        per_layer = self.region.block_bytes // num_layers
        nbytes = src_ids.size * (end - first) * per_layer
        started = time.perf_counter()
        if remote.ipc is not None:
            assert self._stream is not None  # a CUDA region's peer
            blocks = self.region.tensor.view(-1).view(torch.uint8).view(self.region.num_blocks, -1)
            peer_blocks = remote.ipc.tensor.view(remote.num_blocks, -1)
            cols = slice(first * per_layer, end * per_layer)
            with self._own_stream():
                if ready is not None:
                    self._stream.wait_event(ready)
                on = self.region.tensor.device
                rows = torch.as_tensor(src_ids, device=on), torch.as_tensor(dst_ids, device=on)
                peer_blocks[rows[1], cols] = blocks[rows[0], cols]
            self._stream.synchronize()
            return TransferStats(nbytes, time.perf_counter() - started, "cuda-ipc")
        if ready is not None:
            ready.synchronize()  # this thread waits; the engine's stream does not
        size, dev = self.region.block_bytes, self.region.device_id
        offsets = first * per_layer, (end - first) * per_layer
        base, rbase = self.region.base_address + offsets[0], remote.base_address + offsets[0]
        src = [(base + int(s) * size, offsets[1], dev) for s in src_ids]
        dst = [(rbase + int(d) * size, offsets[1], remote.device_id) for d in dst_ids]
        seconds = self._nixl_write(peer, src, dst, b"", deadline_s, yield_gil=True)
        return TransferStats(nbytes, seconds, self.transport)

    def _endpoints(
        self, peer: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
    ) -> tuple[_Peer, Any, Any]:
        """The peer and both id lists checked (no partial effect: before anything moves)."""
        remote = self._peers.get(peer)
        if remote is None:
            raise TransferError(f"unknown or removed peer {peer}")
        src_ids = checked_ids(src_block_ids, self.region.num_blocks, "source")
        dst_ids = checked_ids(dst_block_ids, remote.num_blocks, "destination")
        if src_ids.shape != dst_ids.shape:
            raise TransferError(f"{src_ids.size} source blocks, {dst_ids.size} destination blocks")
        return remote, src_ids, dst_ids

    def notify(self, peer: str, notification: bytes) -> None:
        """Send a notification alone (after a layer-wise transfer's last group landed)."""
        if peer not in self._peers:
            raise TransferError(f"unknown or removed peer {peer}")
        try:
            self._agent.send_notif(peer, notification)
        except _nixl_errors() as err:
            raise TransferError(f"notification to {peer} failed: {type(err).__name__}") from err

    def layer_checksums(self, block_ids: Sequence[int], layers: tuple[int, int]) -> tuple[str, ...]:
        """Checksums of the blocks' bytes of layers `[a, b)` (`layer_groups.layer_checksums`)."""
        with self._own_stream():
            return layer_checksums(self.region, block_ids, layers)

    def _nixl_write(
        self,
        peer: str,
        src: list[tuple[int, int, int]],
        dst: list[tuple[int, int, int]],
        notification: bytes,
        deadline_s: float,
        yield_gil: bool = False,
    ) -> float:
        """One NIXL WRITE of these (address, length, device) ranges; its seconds once done.
        `yield_gil`: let other threads run between polls (a layer group's write polls while the
        engine thread launches the next layers)."""
        src_descs = self._agent.get_xfer_descs(src, self._mem)
        dst_descs = self._agent.get_xfer_descs(dst, self._mem)
        started = time.perf_counter()
        errors = _nixl_errors()
        try:
            handle = self._agent.initialize_xfer("WRITE", src_descs, dst_descs, peer, notification)
        except errors as err:  # e.g. the peer's process is gone
            raise TransferError(f"transfer to {peer} failed: {type(err).__name__}") from err
        try:
            state = self._agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline_s:
                    raise TransferError(f"transfer to {peer} passed its deadline")
                if yield_gil:
                    time.sleep(0)
                state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError(f"transfer to {peer} failed")
        except errors as err:  # e.g. NIXL_ERR_REMOTE_DISCONNECT when the peer died
            raise TransferError(f"transfer to {peer} failed: {type(err).__name__}") from err
        finally:
            with contextlib.suppress(*errors):
                self._agent.release_xfer_handle(handle)
        return time.perf_counter() - started

    def _write_ipc(
        self, peer: str, remote: _Peer, src_ids: Any, dst_ids: Any, note: bytes
    ) -> TransferStats:
        assert remote.ipc is not None and self._stream is not None  # a CUDA region's peer
        size = self.region.block_bytes
        src = self.region.tensor.view(-1).view(torch.uint8)
        started = time.perf_counter()
        try:
            if count_runs(src_ids, dst_ids) <= _MAX_COPY_CALLS:
                with self._own_stream():
                    for s, d, n in coalesce(src_ids, dst_ids):
                        dst = remote.ipc.tensor[d * size : (d + n) * size]
                        dst.copy_(src[s * size : (s + n) * size])
            else:  # many scattered runs: one kernel, replayed from a graph (ipc_copy.py)
                if remote.copier is None:
                    words = torch.int64 if size % 8 == 0 else torch.uint8
                    remote.copier = GraphedBlockCopy(
                        src.view(words).view(self.region.num_blocks, -1),
                        remote.ipc.tensor.view(words).view(-1, size // words.itemsize),
                        self._stream,
                    )
                remote.copier.copy(src_ids, dst_ids)
        finally:  # every byte landed (and the copier's pinned ids were read) before the note
            self._stream.synchronize()
        self._agent.send_notif(peer, note)
        seconds = time.perf_counter() - started
        return TransferStats(src_ids.size * size, seconds, "cuda-ipc")

    def notifications(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for peer, payloads in self._agent.get_new_notifs().items():
            out.extend((peer, bytes(p)) for p in payloads)
        return out

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_peer(peer)
        self._agent.deregister_memory(self._reg)
