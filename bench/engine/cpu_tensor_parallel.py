"""Tensor parallelism on CPU: decode step time at TP=2 (gloo) against TP=1, and what a step spends
in collectives (issue 25); then, on paper, what TP=2 and TP=4 should give on H200s.

The model is random-weight, SmolLM2-135M-sized but with heads that split over 2 and 4 ranks
(`--layers` 24, hidden 512, 8 heads, 4 KV heads, MLP 1536, vocabulary 49,155, float32). For each
setup and each number of running requests N it prefills N prompts of `--prompt-tokens`, then
times `--steps` decode steps one by one (median and p90) and, on rank 0, the wall time inside
each collective (`TpGroup.timed`: gloo's collectives are synchronous, so this is their share of
the step, waiting for the slower rank included) and in handing the step to the other rank
(`RankSet.send`: pickling the inputs and a socket write). Setups: TP=1 on one torch thread (the
baseline) and TP=2 with one thread per rank. Rounds alternate the setups, so a noisy machine
spreads its noise over both. Rank 0's time inside a collective includes waiting for the other
rank to get there, which on a shared, oversubscribed machine is most of it; so the collectives
are also timed alone first, between two processes that do nothing else (gloo over loopback, the
message sizes of a step), and a step's pure communication is estimated from those.

The paper part takes the single-H200 figures of bench/engine/README.md (Llama-3-8B shape, bf16)
and the NVLink bandwidths of docs/benchmarks.md, with the assumptions printed beside them.

Run: .venv/bin/python -P bench/engine/cpu_tensor_parallel.py \
         | tee bench/engine/cpu_tensor_parallel.txt
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SETUPS = (("TP=1", 1, 1), ("TP=2", 2, 1))
HIDDEN, VOCAB_SHARD = 512, 24_578  # the model's hidden size; its vocabulary over 2 ranks


@dataclass
class Sample:
    step_ms: list[float] = field(default_factory=list)
    ops_ms: dict[str, list[float]] = field(default_factory=dict)


def build(model_dir: Path, tp: int, threads: int, num_blocks: int) -> Any:
    from kvrail.worker.engine.config import EngineConfig
    from kvrail.worker.ranks.build import build_engine

    torch.set_num_threads(threads)
    config = EngineConfig(
        num_blocks=num_blocks, block_size=16, max_num_batched_tokens=4096, max_num_seqs=64,
        max_model_len=1024, async_scheduling=False,
    )  # fmt: skip
    return build_engine(
        str(model_dir), config, dtype=torch.float32, device_type="cpu",
        tensor_parallel_size=tp, torch_num_threads=threads,
    )  # fmt: skip


def measure(built: Any, num_requests: int, args: argparse.Namespace, seed: int) -> Sample:
    from kvrail.sampling import SamplingParams
    from kvrail.worker.testing import assert_engine_empty

    engine = built.engine
    group = engine.model.group
    sample = Sample()
    sent_s = [0.0]
    if built.ranks is not None:  # time what handing a step to the other rank costs
        engine.runner.peers = engine.peers = _Timed(built.ranks.send, sent_s)
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)
    ids = [f"r{seed}-{i}" for i in range(num_requests)]
    for i, request_id in enumerate(ids):
        prompt = [
            100 + (seed * 7919 + i * 104729 + j * 31) % 40_000 for j in range(args.prompt_tokens)
        ]
        engine.add_request(request_id, prompt, params)
    while any(not engine.scheduler.requests[r].output_token_ids for r in ids):
        engine.step()  # prefill every prompt first
    group.timed = True
    for _ in range(args.steps):
        group.seconds_by_op.clear()
        sent_s[0] = 0.0
        started = time.perf_counter()
        engine.step()
        sample.step_ms.append((time.perf_counter() - started) * 1e3)
        ops = {**group.seconds_by_op, "send": sent_s[0]} if built.ranks else {}
        for op, seconds in ops.items():
            sample.ops_ms.setdefault(op, []).append(seconds * 1e3)
    group.timed = False
    for request_id in ids:
        engine.abort(request_id)
    assert_engine_empty(engine)
    return sample


class _Timed:
    """`RankPeers` that times `send`."""

    def __init__(self, send: Any, into: list[float]) -> None:
        self._send, self._into, self.size = send, into, 2

    def send(self, command: Any) -> None:
        started = time.perf_counter()
        self._send(command)
        self._into[0] += time.perf_counter() - started


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) >= 10 else max(values)


def p10(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[0] if len(values) >= 10 else min(values)


def collectives(rows: list[int]) -> list[tuple[str, int]]:
    return [(op, n) for op in ("all_reduce", "gather") for n in rows]


def collective_peer(port: int, rank: int, iters: int, rows: list[int]) -> dict[str, list[float]]:
    """One of two processes timing gloo's collectives at a step's message sizes (microseconds)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,  # type: ignore[attr-defined]
                          timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    out: dict[str, list[float]] = {}
    for op, n in collectives(rows):
        x = torch.randn(n, HIDDEN if op == "all_reduce" else VOCAB_SHARD)
        parts = [torch.empty_like(x) for _ in range(2)] if rank == 0 else None
        times = []
        for i in range(iters + 20):
            dist.barrier()
            started = time.perf_counter()
            if op == "all_reduce":
                dist.all_reduce(x)
            else:
                dist.gather(x, parts, dst=0)
            if i >= 20:
                times.append((time.perf_counter() - started) * 1e6)
        out[f"{op} {n}"] = times
    dist.destroy_process_group()
    return out


def time_collectives(iters: int, rows: list[int]) -> dict[str, list[float]]:
    import subprocess
    import sys

    from kvrail.local.procs import free_port

    port = free_port()
    peer = subprocess.Popen([sys.executable, "-P", __file__, "--collective-peer", str(port),
                             "--collective-iters", str(iters),
                             "--requests", *map(str, rows)])  # fmt: skip
    try:
        return collective_peer(port, 0, iters, rows)
    finally:
        peer.wait(120)


def paper() -> None:
    """Expected H200 figures for TP=2 and TP=4 from the single-GPU measurements."""
    layers, hidden, vocab, bf16 = 32, 4096, 128_256, 2
    one_gpu = {"batch 1": 1e3 / 236.6, "batch 32": 5.07}  # ms per decode step (README, fifth)
    prefill_8k_s = 0.213
    # NCCL all-reduce of a few KiB-MiB inside one NVLink domain: latency-bound; 8-15 us is the
    # usual range for torch.distributed's NCCL on H100/H200 (a one-shot custom all-reduce as in
    # vLLM reaches ~5 us). Bandwidths: 2 x H200 NV18 478 GB/s one way (docs/benchmarks.md);
    # an 8-GPU HGX H200 through NVSwitch 450 GB/s one way per GPU.
    nvlink = {2: 478e9, 4: 450e9}
    print("\n## On paper: Llama-3-8B shape, bf16, H200 (to be checked by the multi-GPU issue)")
    print(f"assumptions: decode step = single-GPU step / T + {2 * layers} all-reduces "
          "(one after O, one after down, per layer) + the logits gather; all-reduce latency "
          "5 / 10 / 15 us (custom one-shot / NCCL LL / NCCL ring), bandwidth term 2(T-1)/T x "
          "bytes / link; weights and KV reads split evenly; prefill = single-GPU prefill / T + "
          "its all-reduces at link bandwidth, no overlap")  # fmt: skip
    print("| figure | 1 GPU | TP=2 (5/10/15 us) | TP=4 (5/10/15 us) |")
    print("|---|---|---|---|")
    for name, step_ms in one_gpu.items():
        rows = 1 if name == "batch 1" else 32
        cells = []
        for tp in (2, 4):
            msg = rows * hidden * bf16
            bw_ms = 2 * (tp - 1) / tp * msg / nvlink[tp] * 1e3
            gather_ms = rows * vocab * bf16 / nvlink[tp] * 1e3 + 0.010
            outs = []
            for lat_us in (5, 10, 15):
                t = step_ms / tp + 2 * layers * (lat_us / 1e3 + bw_ms) + gather_ms
                outs.append(f"{t:.2f} ms ({rows * 1e3 / t:,.0f} tok/s)")
            cells.append(" / ".join(outs))
        print(f"| decode step, {name} | {step_ms:.2f} ms ({rows * 1e3 / step_ms:,.0f} tok/s) | "
              f"{cells[0]} | {cells[1]} |")  # fmt: skip
    cells = []
    for tp in (2, 4):
        msg = 8192 * hidden * bf16
        comm_s = 2 * layers * (2 * (tp - 1) / tp * msg / nvlink[tp])
        cells.append(f"{prefill_8k_s / tp + comm_s:.3f} s (all-reduces {comm_s * 1e3:.1f} ms)")
    print(f"| prefill 8,192 tokens | {prefill_8k_s:.3f} s | {cells[0]} | {cells[1]} |")
    print(
        "Decode tok/s are the decode phase's (rows per step / step time). These are upper "
        "bounds on the speedup: GEMMs over 1/T of each weight lose some efficiency, and the "
        "launches and elementwise kernels of a step do not shrink with T. Memory floor of a "
        "batch-1 step: 16 GB of weights / T at 4.27 TB/s = 1.87 ms (TP=2), 0.94 ms (TP=4)."
    )
    print("KV per token per rank: 128 KiB / T (8 KV heads split: 4 at TP=2, 2 at TP=4); a handoff "
          "moves T shards in parallel, rank i to rank i, each 1/T of the bytes.")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paper-only", action="store_true")
    parser.add_argument("--collective-peer", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--collective-iters", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.collective_peer is not None:
        collective_peer(args.collective_peer, 1, args.collective_iters, args.requests)
        return 0
    if args.paper_only:
        paper()
        return 0
    from kvrail.worker.testing import write_random_model

    print(f"# cpu_tensor_parallel: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start, "
          f"torch {torch.__version__}")  # fmt: skip
    print(f"model: random Llama, {args.layers} layers, hidden 512, 8 heads, 4 KV heads, MLP 1536, "
          f"vocab 49,155, float32; prompts of {args.prompt_tokens} tokens, {args.steps} timed "
          f"decode steps per point, {args.rounds} rounds")  # fmt: skip
    alone = time_collectives(args.collective_iters, args.requests)
    print("\n## gloo collectives alone, two processes, loopback (us)")
    print("| collective | rows | bytes per rank | median | p10 | p90 |")
    print("|---|---|---|---|---|---|")
    for op, rows in collectives(args.requests):
        v = alone[f"{op} {rows}"]
        width = HIDDEN if op == "all_reduce" else VOCAB_SHARD
        print(f"| {op} | {rows} | {rows * width * 4:,} | {statistics.median(v):.0f} | "
              f"{p10(v):.0f} | {p90(v):.0f} |")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model(
            Path(tmp) / "m", seed=1, num_hidden_layers=args.layers, hidden_size=512,
            num_attention_heads=8, num_key_value_heads=4, intermediate_size=1536,
        )  # fmt: skip
        num_blocks = max(args.requests) * ((args.prompt_tokens + args.steps + 8) // 16 + 2) + 8
        results: dict[tuple[str, int], Sample] = {}
        for round_ in range(args.rounds):
            for name, tp, threads in SETUPS:
                built = build(model_dir, tp, threads, num_blocks)
                try:
                    for n in args.requests:
                        got = measure(built, n, args, seed=round_ * 100 + n)
                        acc = results.setdefault((name, n), Sample())
                        acc.step_ms += got.step_ms
                        for op, values in got.ops_ms.items():
                            acc.ops_ms.setdefault(op, []).extend(values)
                finally:
                    if built.ranks is not None:
                        built.ranks.close()
                    built.engine.model.group.close()
    per_step = 2 * args.layers + 1  # O and down in every layer, and the embedding
    print("\n## Decode step time (ms), all rounds")
    print("| setup | N | median | p10 | p90 | vs TP=1 (median, p10) | rank 0 in all-reduce | "
          "gather | broadcast | send | of the step (waits included) | pure communication, "
          "from the collectives alone |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.requests:
        base = results[("TP=1", n)].step_ms
        for name, tp, _threads in SETUPS:
            s = results[(name, n)]
            med = statistics.median(s.step_ms)
            ops = {op: statistics.median(v) for op, v in s.ops_ms.items()}
            parts = [f"{ops[op]:.2f}" if op in ops else "-" for op in
                     ("all_reduce", "gather", "broadcast", "send")]  # fmt: skip
            share = f"{100 * sum(ops.values()) / med:.0f}%" if ops else "-"
            pure = "-"
            if tp > 1:
                ms = (per_step * statistics.median(alone[f"all_reduce {n}"])
                      + statistics.median(alone[f"gather {n}"])) / 1e3  # fmt: skip
                pure = f"{ms:.1f} ms ({100 * ms / med:.0f}% of the median step)"
            vs = (f"{100 * (med / statistics.median(base) - 1):+.0f}%, "
                  f"{100 * (p10(s.step_ms) / p10(base) - 1):+.0f}%")  # fmt: skip
            print(f"| {name} | {n} | {med:.1f} | {p10(s.step_ms):.1f} | {p90(s.step_ms):.1f} | "
                  f"{vs} | {' | '.join(parts)} | {share} | {pure} |")  # fmt: skip
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    paper()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
