"""`python -P -m kvrail.worker.ranks --commands FD --transfers FD --lifeline FD`: one rank (1..N-1)
of a tensor-parallel worker, started by the worker process (rank 0, `launch.py`), never by hand.

It reads its `RankSpec` from the command socket, says `Started`, joins the group through rank 0's
store, builds its model shard (reading only its shard of each weight) and its KV shard, registers
the KV shard as its own NIXL agent (served to rank 0 on the transfer socket by a thread), says
`Ready` with that agent's metadata, and then runs rank 0's commands until `Stop`
(`kvrail.worker.engine.rank_loop`). It dies with rank 0: when the lifeline pipe closes (rank 0's
process is gone, however it died) it exits at once, even from inside a collective. It ignores
SIGTERM and SIGINT: rank 0 alone decides when it stops (a terminal's Ctrl-C or a signal to the
whole process group reaches the ranks too, and must not fail a worker that drains cleanly). Logs
hold ids and sizes only.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from kvrail.errors import KvrailError
from kvrail.worker.engine.config import DTYPES, kv_cache_dtype
from kvrail.worker.engine.model_runner import ModelRunner
from kvrail.worker.engine.rank_commands import RankCommand
from kvrail.worker.engine.rank_loop import serve
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.models.llama import LlamaForCausalLM
from kvrail.worker.models.loader import load
from kvrail.worker.parallel.group import TpGroup
from kvrail.worker.ranks.spec import Failed, RankSpec, Ready, Started
from kvrail.worker.transfer.kv_connector import KvConnector
from kvrail.worker.transfer.rank_link import serve_transfers

log = logging.getLogger("kvrail.worker.rank")

EXIT_RANK_0_GONE = 70


def _watch_lifeline(fd: int) -> None:
    """Exit the process as soon as rank 0's end of the lifeline closes."""
    while os.read(fd, 1):
        pass
    os._exit(EXIT_RANK_0_GONE)


def run(spec: RankSpec, commands: Connection, transfers: Connection) -> int:
    device = torch.device("cuda", spec.rank) if spec.device_type == "cuda" else torch.device("cpu")
    dtype = DTYPES[spec.dtype]
    store = TCPStore(
        "127.0.0.1", spec.store_port, spec.size, is_master=False,
        timeout=datetime.timedelta(seconds=spec.collective_timeout_s),
    )  # fmt: skip
    group = TpGroup.join(spec.rank, spec.size, store, device, spec.collective_timeout_s)
    loaded = load(spec.source, lazy=True, tokenizer=False)
    model = LlamaForCausalLM.build(
        loaded.config, loaded.state_dict, dtype=dtype, device=device,
        quantization=spec.quantization, group=group,
    )  # fmt: skip
    del loaded
    shape = model.shape
    kv_cache = KVCache.allocate(
        spec.num_blocks, shape.num_layers, spec.block_size, model.layout.num_local_kv_heads,
        shape.head_dim, kv_cache_dtype(spec.kv_dtype, dtype, device.type), device,
    )  # fmt: skip
    connector = KvConnector(spec.agent_name, kv_cache) if spec.agent_name else None
    stopping = threading.Event()
    server = None
    if connector is not None:
        server = threading.Thread(
            target=serve_transfers, args=(transfers, connector, stopping), name="transfers",
            daemon=True,
        )  # fmt: skip
        server.start()
    metadata = connector.metadata() if connector is not None else b""
    commands.send(Ready(spec.rank, metadata, kv_cache.nbytes))
    log.info(
        "rank ready rank=%d size=%d device=%s kv_bytes=%d kv_heads=%d",
        spec.rank, spec.size, device, kv_cache.nbytes, model.layout.num_local_kv_heads,
    )  # fmt: skip

    def next_command() -> RankCommand:
        command: RankCommand = pickle.loads(commands.recv_bytes())
        return command

    try:
        serve(next_command, ModelRunner(model, kv_cache, device))
    finally:
        stopping.set()
        if server is not None:
            server.join(timeout=5.0)
        if connector is not None:
            connector.close()
        group.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P -m kvrail.worker.ranks")
    parser.add_argument("--commands", type=int, required=True)
    parser.add_argument("--transfers", type=int, required=True)
    parser.add_argument("--lifeline", type=int, required=True)
    args = parser.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_watch_lifeline, args=(args.lifeline,), daemon=True).start()
    commands, transfers = Connection(args.commands), Connection(args.transfers)
    spec: RankSpec = commands.recv()
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s rank={spec.rank} %(message)s",
    )
    if spec.torch_num_threads is not None:
        torch.set_num_threads(spec.torch_num_threads)
    commands.send(Started(spec.rank, os.getpid()))
    try:
        return run(spec, commands, transfers)
    except (EOFError, ConnectionError):
        log.info("rank 0 is gone; exiting rank=%d", spec.rank)
        return 1
    except (KvrailError, RuntimeError, OSError, ValueError) as err:
        log.exception("rank failed rank=%d", spec.rank)
        try:
            commands.send(Failed(spec.rank, f"{type(err).__name__}: {err}"))
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
