"""Remote TTFT with layer-wise KV transfer against one whole-prompt write (issue 49).

Two processes on one GPU: a writer runs kvrail's engine on a Llama-3-8B-shaped model (random
weights, bf16, `bench/engine/gpu_llama3_8b.py`'s) and writes each prompt's KV into a reader's
region (the decode worker's), through kvrail's own `KvConnector` and, layer-wise, the prefill
role's own `LayeredWrite` fed by the engine's layer sinks (docs/layerwise.md). TTFT here is from
the prompt's submission to the moment the reader holds the completion notification (both
processes read the same CLOCK_MONOTONIC), so it is prefill + transfer for the whole-prompt write
and what overlap leaves of it layer-wise; the decode worker's validation and first step, the
same either way, are not in it.

Links (each a fresh writer/reader pair, UCX reads its environment at start):
- `ucx-tcp`: NIXL with UCX restricted to TCP (on loopback) and cuda_copy: a slow link for real;
- `capped`: NIXL with UCX's default transports (VRAM to VRAM by `cuda_ipc` on one GPU) under a
  link of `--cap-gbs` this script applies (`CappedLink`): the writes (groups, or the whole
  prompt) cross it one after another, each from when its bytes exist (a group's: when the
  prefill wrote its layers) or the link carried the write before, whichever is later;
- `cuda-ipc`: kvrail's same-node fast path, for no regression.
Per link and prompt length (2k, 8k, 32k tokens; one engine step each, `--max-batched-tokens`),
the methods alternate (whole, G=2, G=4, G=8, whole, ...; with `--auto` also `auto`, the count
`kv_transfer_layer_groups: auto` chooses per prompt, `roles/group_choice.py`, from the link's
bandwidth and the prefill's speed as measured by every write and prefill of the run so far, the
untimed round's included) over `--iters` rounds after one untimed
round (the last round's writes land in zeroed blocks and are checked block by block by
checksum, untimed work outside the TTFT), and the median is reported with the prefill alone
(the engine's time to the first token) and the whole write's transfer time, and the issue's
bound for layer-wise:
`max(prefill, transfer) + transfer / G + 10 ms`; for `auto`, G is the count it chose most often,
and when that is a whole write the bound is the whole write's TTFT + 2% (no regression).

With `--receiver-decode ROWS` the reader also runs kvrail's engine on the same model, decoding
ROWS other requests without pause (restarted as they finish), and each line adds the worst and
the median of the reader's decode steps that overlapped the prompt's prefill and transfer,
against the steps of an idle second (no prefill, no transfer) measured first: what the
transfer costs the receiving worker's other requests. The writer's prefill runs on the same GPU,
so it slows those steps for every method alike; compare the methods, not against idle alone.
In that mode a notification is seen between two decode steps, so TTFT is coarser: take TTFT
from a run without it.

Not measured here (left): chunked prefills (`--max-batched-tokens` below a prompt: the blocks
each earlier chunk fills go whole while the next chunk computes).

On the lent GPU (from the repository root, one H100 or H200):
  source hack/device-env.sh && python3 -P bench/transfer/layerwise.py \
      --out $OUT/layerwise.json | tee $OUT/layerwise.txt
Here, end to end on a tiny model: .venv/bin/python -P bench/transfer/layerwise.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

LINKS: dict[str, dict[str, Any]] = {  # in this order: the restricted UCX environment last
    "capped": {"env": {}, "prefer_ipc": False, "cap": True},
    "cuda-ipc": {"env": {}, "prefer_ipc": True, "cap": False},
    "ucx-tcp": {"env": {"UCX_TLS": "tcp,cuda_copy,self"}, "prefer_ipc": False, "cap": False},
}
BLOCK_SIZE = 16
AUTO = -1  # the method `auto` among the group counts (0: one whole write)
_LOOP = asyncio.new_event_loop()  # one for every layer-wise `finish` (a new one costs ms)
_PROMPTS = itertools.count()  # every prompt of the run gets a first token of its own


def _reader(conn: Connection, env: dict[str, str], args: dict[str, Any]) -> None:
    """The decode side: a region in the engine's layout; reports when each notification came."""
    os.environ.update(env)
    import torch

    from kvrail.worker.kv_cache import KVCache
    from kvrail.worker.transfer.envelope import block_checksums
    from kvrail.worker.transfer.kv_connector import KvConnector

    region = KVCache.allocate(
        args["num_blocks"], args["num_layers"], BLOCK_SIZE, args["num_kv_heads"],
        args["head_dim"], getattr(torch, args["dtype"]), args["device"],
    )  # fmt: skip
    nixl = KvConnector("reader-1", region, prefer_ipc=args["prefer_ipc"])
    decode = _Decode(args) if args["decode_rows"] else None
    conn.send(nixl.metadata())
    nixl.add_peer(conn.recv())
    while True:
        if conn.poll():
            msg = conn.recv()
            if msg == "bye":
                break
            ask, ids = msg  # ("zero", ids) before a verified write, ("sums", ids) after it
            if ask == "steps":  # ids: (from, to) on CLOCK_MONOTONIC
                conn.send(decode.steps_within(*ids) if decode else None)
                continue
            if ask == "zero":
                region.zero_blocks(torch.as_tensor(ids, device=region.tensor.device))
                if region.tensor.is_cuda:  # done before the writer's copies start
                    torch.cuda.synchronize()
                conn.send("zeroed")
            else:
                conn.send(block_checksums(region, ids))
        for _peer, payload in nixl.notifications():
            conn.send((payload.decode(), time.monotonic()))
        decode.step() if decode else time.sleep(0.0002)
    nixl.close()


class _Decode:
    """The receiving worker's other requests: `decode_rows` rows decoding without pause on the
    same model (random weights), each step's (start, end) kept."""

    def __init__(self, args: dict[str, Any]) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
        import gpu_llama3_8b as gpu

        from kvrail.sampling import SamplingParams

        hf, config = gpu.random_model(args["smoke"])
        self.engine = gpu.build_engine(
            hf, config, args["decode_kv_gib"], graphs=not args["smoke"], max_model_len=1024
        )
        del hf
        self.rows = args["decode_rows"]
        self.params = SamplingParams(max_tokens=256, ignore_eos=True)
        self.prompts = gpu.prompts(self.rows, 128, 5)
        self.added = 0
        self.spans: list[tuple[float, float]] = []  # (start, end) of every step
        self.sync = gpu.sync

    def step(self) -> None:
        while len(self.engine.scheduler.requests) < self.rows:
            prompt = self.prompts[self.added % self.rows]
            self.engine.add_request(f"d{self.added}", prompt, self.params)
            self.added += 1
        started = time.monotonic()
        self.engine.step()
        self.sync()
        self.spans.append((started, time.monotonic()))

    def steps_within(self, start: float, end: float) -> dict[str, float]:
        """The worst and median step overlapping [start, end], and how many."""
        took = [b - a for a, b in self.spans if b > start and a < end]
        self.spans = [span for span in self.spans if span[1] > end - 5.0][-100_000:]
        if not took:
            return {"steps": 0, "worst_s": 0.0, "median_s": 0.0}
        return {"steps": len(took), "worst_s": max(took), "median_s": statistics.median(took)}


class CappedLink:
    """A connector whose writes cross a link of `bytes_per_s`, one after another: a write's
    bytes start crossing once they exist and the link has carried the write before it, and it
    lands when they have crossed and the transport beneath has moved them (whichever is later).
    A whole write's notification goes only then (sent with the bytes, the reader would see it
    before the link could have carried them)."""

    def __init__(self, inner: Any, bytes_per_s: float | None) -> None:
        self._inner, self._rate = inner, bytes_per_s
        self.region, self.supports_layers = inner.region, True
        self._free_at = 0.0  # when the link has carried every write before

    def _hold(self, started: float, stats: Any) -> Any:
        """Hold a write whose bytes existed at `started` until the link has carried them; its
        seconds count from `started`, as the NIXL connector beneath counts a group's (from its
        layers' readiness, not from its issue)."""
        if self._rate:
            self._free_at = max(started, self._free_at) + stats.num_bytes / self._rate
            time.sleep(max(0.0, self._free_at - time.perf_counter()))
        return dataclasses.replace(stats, seconds=time.perf_counter() - started)

    def write(self, peer: str, src: Any, dst: Any, note: bytes, deadline: float) -> Any:
        if not self._rate:
            return self._inner.write(peer, src, dst, note, deadline)
        started = time.perf_counter()
        stats = self._hold(started, self._inner.write(peer, src, dst, b"", deadline))
        self._inner.notify(peer, note)
        return stats

    def write_layers(
        self, peer: str, src: Any, dst: Any, layers: tuple[int, int], deadline: float,
        ready: Any = None,
    ) -> Any:  # fmt: skip
        """One layer group. Its bytes can cross the link only once the prefill wrote them: the
        link's clock for them starts when `ready` passed, or when the link carried the group
        before, whichever is later; not when the group was issued (which would let the link
        carry, while it waited, bytes that did not exist yet), nor when the transport beneath
        finished the group before (on one GPU its copies wait for the prefill's kernels, which
        a NIC's DMA would not)."""
        if self._rate and ready is not None:
            ready.synchronize()
        started = time.perf_counter()
        stats = self._inner.write_layers(peer, src, dst, layers, deadline, ready)
        return self._hold(started, stats)

    def notify(self, peer: str, note: bytes) -> None:
        self._inner.notify(peer, note)

    def layer_checksums(self, *a: Any) -> Any:
        return self._inner.layer_checksums(*a)


def _arrival(conn: Connection, tag: str, timeout_s: float = 120.0) -> float:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the reader never saw {tag}")
    got, at = conn.recv()
    assert got == tag, (got, tag)
    return float(at)


def _measure_link(link: str, args: argparse.Namespace, engine: Any) -> list[dict[str, Any]]:
    import torch

    from kvrail.messages import PrefillJob
    from kvrail.sampling import SamplingParams
    from kvrail.worker.roles.group_choice import GroupChoice
    from kvrail.worker.roles.layerwise import LayeredWrite
    from kvrail.worker.transfer.faults import TransportFaults
    from kvrail.worker.transfer.kv_connector import KvConnector
    from kvrail.worker.transfer.layer_groups import plan_groups
    from kvrail.worker.transfer.link_speed import WriteTiming

    spec = LINKS[link]
    saved = {key: os.environ.get(key) for key in spec["env"]}
    os.environ.update(spec["env"])  # read by UCX as the writer's agent starts
    cache = engine.kv_cache
    num_layers = cache.num_layers
    need = -(-max(args.prompts) // BLOCK_SIZE)
    shape = cache.tensor.shape
    reader_args = {
        "num_blocks": need + 1, "num_layers": num_layers, "num_kv_heads": shape[4],
        "head_dim": shape[5], "dtype": str(cache.tensor.dtype).removeprefix("torch."),
        "device": args.device, "prefer_ipc": spec["prefer_ipc"],
        "decode_rows": args.receiver_decode, "decode_kv_gib": 0.05 if args.smoke else 4.0,
        "smoke": args.smoke,
    }  # fmt: skip
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(theirs, spec["env"], reader_args), daemon=True)
    proc.start()
    agent = f"writer-{link}"
    nixl = KvConnector(agent, cache, prefer_ipc=spec["prefer_ipc"])
    peer = nixl.add_peer(ours.recv())
    ours.send(nixl.metadata())
    link_ = CappedLink(nixl, args.cap_gbs * 1e9 if spec["cap"] else None)
    thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    # what a prefill worker with `auto` learns: every write's and every prefill's time, any method
    choice = GroupChoice("auto", nixl, BLOCK_SIZE, max(args.prompts))
    rows: list[dict[str, Any]] = []
    idle = None
    try:
        if args.receiver_decode:  # the reader's decode steps alone, once it has run a while
            time.sleep(2.0)
            ours.send(("steps", (time.monotonic() - 1.0, time.monotonic())))
            idle = ours.recv()
            print(f"{link:9} receiver decode, {args.receiver_decode} rows, idle: "
                  f"worst {idle['worst_s'] * 1e3:.2f} ms median {idle['median_s'] * 1e3:.2f} ms "
                  f"({idle['steps']} steps)", flush=True)  # fmt: skip
        for length in args.prompts:
            g = torch.Generator().manual_seed(length)
            base_ids = torch.randint(3, args.vocab - 1, (length,), generator=g).tolist()
            dest = tuple(range(1, -(-length // BLOCK_SIZE) + 1))
            methods = [0, *args.groups, *([AUTO] if args.auto else [])]
            samples: dict[int, list[tuple[float, float, float]]] = {m: [] for m in methods}
            chosen: list[int] = []  # auto's group counts in the timed rounds
            details: dict[int, list[Any]] = {m: [] for m in methods}  # LayeredStats
            steps: dict[int, list[dict[str, float]]] = {m: [] for m in methods}
            for rnd in range(args.iters + 1):
                for groups in methods:
                    n = next(_PROMPTS)
                    rid = f"{link}-{length}-{groups}-{n}"
                    # a first token of its own: no prefix-cache hit on an earlier prompt
                    token_ids = [3 + n % (args.vocab - 4), *base_ids[1:]]
                    job = PrefillJob(
                        request_id=rid, token_ids=tuple(token_ids), fingerprint="bench",
                        dest_worker_id="r", dest_incarnation=1, dest_agent_name=peer,
                        dest_block_ids=dest, first_block_index=0,
                        deadline_unix_s=time.time() + 300, sampling=params,
                    )  # fmt: skip
                    plan = choice.plan(job) if groups == AUTO else plan_groups(num_layers, groups)
                    ttft, prefill, stats, window, layered = _one(
                        engine, link_, thread, ours, job, plan, LayeredWrite, TransportFaults(),
                        verify=rnd == args.iters,  # the last round
                    )  # fmt: skip
                    choice.computed(len(token_ids), prefill)
                    blocks = len(job.dest_block_ids)
                    choice.wrote(
                        peer, layered.writes if layered else (WriteTiming.whole(stats, blocks),)
                    )
                    transfer = stats.seconds if not plan else 0.0
                    if rnd:  # the first round is untimed
                        samples[groups].append((ttft, prefill, transfer))
                        if layered is not None:
                            details[groups].append(layered)
                        chosen += [len(plan)] if groups == AUTO else []
                        if args.receiver_decode:
                            ours.send(("steps", window))
                            steps[groups].append(ours.recv())
            whole = samples[0]
            base_prefill = statistics.median(s[1] for s in whole)
            base_transfer = statistics.median(s[2] for s in whole)
            base_ttft = statistics.median(s[0] for s in whole)
            for groups in methods:
                ttft = statistics.median(s[0] for s in samples[groups])
                g = max(set(chosen), key=chosen.count) if groups == AUTO else groups
                bound = _bound(g, base_prefill, base_transfer, base_ttft) if groups else 0.0
                row = {
                    "link": link, "prompt_tokens": length,
                    "layer_groups": "auto" if groups == AUTO else groups,
                    "ttft_s": ttft, "ttft_all_s": [s[0] for s in samples[groups]],
                    "prefill_s": base_prefill, "whole_transfer_s": base_transfer,
                    "bound_s": bound if groups else None,
                    "meets_bound": (ttft <= bound) if groups else None,
                    "kv_bytes": len(dest) * cache.block_bytes,
                }  # fmt: skip
                if groups == AUTO:  # and what it had learned of the link by the end
                    row["chosen_groups"] = chosen
                    learned = choice.links.estimate(peer, nixl.transport_to(peer))
                    row["auto_link"] = {"bytes_per_s": learned.bytes_per_s,
                                        "busy_block_s": learned.busy_block_s}  # fmt: skip
                if groups:  # where the time went: this method's own prefill, each group's write
                    row["method_prefill_s"] = [s[1] for s in samples[groups]]
                    row["groups_landed_s"] = [
                        [w.landed_s for w in d.writes] for d in details[groups]
                    ]
                    row["groups_write_s"] = [[w.seconds for w in d.writes] for d in details[groups]]
                seen = [got for got in steps[groups] if got["steps"]]
                if seen:
                    row["receiver_decode"] = {
                        "rows": args.receiver_decode, "idle": idle,
                        "worst_s": max(got["worst_s"] for got in seen),
                        "median_s": statistics.median(got["median_s"] for got in seen),
                    }  # fmt: skip
                rows.append(row)
                picked = ",".join(map(str, sorted(set(chosen))))
                name = f"auto:{picked}" if groups == AUTO else groups
                tails = [d.tail_s for d in details[groups]]  # none where auto wrote whole
                tail = f"{statistics.median(tails) * 1e3:.1f} ms" if tails else "-"
                print(
                    f"{link:9} {length:6d} tok  G={name or 'whole':>7}  TTFT "
                    f"{ttft * 1e3:9.2f} ms   prefill {base_prefill * 1e3:8.2f} ms  "
                    f"whole transfer {base_transfer * 1e3:8.2f} ms  "
                    + (f"bound {bound * 1e3:8.2f} ms {'met' if ttft <= bound else 'NOT met'}"
                       f"  own prefill {statistics.median(row['method_prefill_s']) * 1e3:.1f} ms"
                       f" tail {tail}" if groups else "")
                    + (f"  decode worst {row['receiver_decode']['worst_s'] * 1e3:.2f} ms median "
                       f"{row['receiver_decode']['median_s'] * 1e3:.2f} ms"
                       if seen else ""),
                    flush=True,
                )  # fmt: skip
    finally:
        ours.send("bye")
        proc.join(30)
        thread.shutdown()
        nixl.close()
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.update({key: value})
    return rows


def _bound(groups: int, prefill: float, transfer: float, whole_ttft: float) -> float:
    """The issue's bound for `groups` layer groups; for a whole write (what `auto` may choose),
    the whole write's own TTFT + 2%: no regression."""
    if not groups:
        return whole_ttft * 1.02
    return max(prefill, transfer) + transfer / groups + 0.010


def _one(
    engine: Any, link: Any, thread: Any, reader: Connection, job: Any, groups: tuple[int, ...],
    layered_type: Any, faults: Any, verify: bool = False,
) -> tuple[float, float, Any, tuple[float, float], Any]:  # fmt: skip
    """One prompt: (TTFT to the reader's notification, prefill alone, the write's TransferStats
    (every group's together), (submitted, notified) on CLOCK_MONOTONIC, the layer-wise write's
    LayeredStats or None).
    `verify`: zero the reader's blocks first and compare every block's checksum after."""
    import torch

    from kvrail.worker.transfer.envelope import block_checksums

    rid, token_ids, dest = job.request_id, list(job.token_ids), job.dest_block_ids
    peer, params = job.dest_agent_name, job.sampling
    if verify:
        reader.send(("zero", list(dest)))
        assert reader.recv() == "zeroed"

    deadline = time.monotonic() + 300
    layered = None
    if groups:
        layered = layered_type(job, groups, link, faults, thread.submit, deadline, BLOCK_SIZE)
        engine.runner.layer_sinks.add(rid, layered.sink)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    started = time.monotonic()
    engine.add_request(rid, token_ids, params, retain_blocks=True)
    while engine.has_unfinished_requests():
        engine.step()
    computed = time.monotonic()
    src = engine.retained_block_ids(rid)
    note = rid.encode()
    written = None
    try:
        if layered is not None:
            written = _LOOP.run_until_complete(layered.finish(src, lambda _sums: note))
            assert written is not None, "the engine handed over no group"
            stats = written.stats
        else:
            stats = link.write(peer, src, dest, note, deadline)
        arrived = _arrival(reader, rid)
        if verify:
            reader.send(("sums", list(dest)))
            assert reader.recv() == block_checksums(engine.kv_cache, src), f"{rid}: KV differs"
    finally:
        engine.runner.layer_sinks.discard(rid)
        engine.release(rid)
    return arrived - started, computed - started, stats, (started, arrived), written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    parser.add_argument("--prompts", nargs="+", type=int, default=[2048, 8192, 32768])
    parser.add_argument("--groups", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--auto", action="store_true",
        help="also `auto`: the count kv_transfer_layer_groups: auto chooses per prompt",
    )  # fmt: skip
    parser.add_argument("--cap-gbs", type=float, default=5.0, help="capped link, GB/s")
    parser.add_argument(
        "--max-batched-tokens", type=int, default=0,
        help="the engine's step budget (0: the longest prompt, so each prompt is one step)",
    )  # fmt: skip
    parser.add_argument("--kv-gib", type=float, default=8.0)
    parser.add_argument(
        "--receiver-decode", type=int, default=0, metavar="ROWS",
        help="the reader also decodes ROWS other requests; reports its steps per method",
    )  # fmt: skip
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU, short runs")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
    import gpu_llama3_8b as gpu

    if args.smoke:
        args.prompts, args.groups, args.iters, args.auto = [64, 256], [2], 1, True
        args.links = [link for link in args.links if link != "cuda-ipc"]
        LINKS["ucx-tcp"]["env"] = {"UCX_TLS": "tcp,self"}
    longest = max(args.prompts)
    gpu.LLAMA3_8B["max_position_embeddings"] = longest + 1024
    hf, config = gpu.random_model(args.smoke)
    args.device, args.vocab = gpu.DEVICE, int(config.vocab_size)
    engine = gpu.build_engine(
        hf, config, 0.05 if args.smoke else args.kv_gib, graphs=False,
        max_model_len=longest + 1024, max_num_batched_tokens=args.max_batched_tokens or longest,
    )  # fmt: skip
    del hf
    print(f"# cap for `capped`: {args.cap_gbs} GB/s; median of {args.iters} after one untimed")
    rows = [row for link in args.links for row in _measure_link(link, args, engine)]
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
