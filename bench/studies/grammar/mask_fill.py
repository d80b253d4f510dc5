"""What the grammar costs the host per decode step: filling the token bitmask for 1 and for 256
rows constrained by the nested order json_schema, and accepting the sampled tokens, per library;
and whether the fill lets go of the GIL (so it can run beside Python and in parallel threads).

    /tmp/gvenv/bin/python bench/studies/grammar/mask_fill.py \
        | tee bench/studies/grammar/mask_fill.txt

Each row walks a valid order (32 different orders, rows started at staggered offsets so that
their states differ: some inside strings, some at keys, numbers or enums); a finished row starts
over. Every filled row is checked to allow the token the row then accepts. The grammar is warm
(each order walked once first): the first walk's extra cost is in compile_time.txt.

Fill modes at 256 rows:
- `serial`: one `fill` call per row from one Python thread (what a simple engine loop does);
- `batch xN`: the library's own batched call (xgrammar `BatchGrammarMatcher`, llguidance
  `LLExecutor`) with N native threads (`--batch-threads`, default 1 and 2: this VM's cores);
- `2 py threads`: two Python threads each filling half the rows with per-row calls: faster than
  `serial` only if the call lets go of the GIL.
`accept` is the per-row `accept_token`/`consume_token` loop; `accept batch` the batched call.
Wall time per step (mean, p99 over `--steps`) and the process CPU time per step (all threads).
The GIL probe: while a background thread repeats a call, how late does the main thread wake from
a 1 ms sleep (p99, max)? A call that holds the GIL for D ms shows lags near D.
"""

from __future__ import annotations

import argparse
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from workload import (
    ORDER_SCHEMA,
    LLGuidance,
    XGrammar,
    allowed,
    load_tokenizer,
    machine_line,
    order_tokens,
    summary,
    versions,
)

NUM_ORDERS = 32


class Rows:
    """`n` matchers, each walking one of the orders from a staggered offset."""

    def __init__(self, lib: Any, compiled: Any, orders: list[list[int]], n: int) -> None:
        self.lib = lib
        self.orders = [orders[r % len(orders)] for r in range(n)]
        self.pos = [(r * 37) % (len(self.orders[r]) - 1) for r in range(n)]
        self.matchers = [lib.matcher(compiled) for _ in range(n)]
        for m, order, pos in zip(self.matchers, self.orders, self.pos, strict=True):
            assert lib.accept_many(m, order[:pos])

    def next_tokens(self) -> list[int]:
        return [order[pos] for order, pos in zip(self.orders, self.pos, strict=True)]

    def check(self, bitmask: torch.Tensor) -> None:
        for row, token in enumerate(self.next_tokens()):
            assert allowed(bitmask, row, token), (self.lib.name, row, token)

    def advance(self) -> None:
        """Move every row on by one; a finished row starts over (not timed)."""
        for r, m in enumerate(self.matchers):
            self.pos[r] += 1
            if self.pos[r] == len(self.orders[r]):
                assert self.lib.finished(m)
                self.lib.reset(m)
                self.pos[r] = 0


def run_mode(
    lib: Any, compiled: Any, orders: list[list[int]], rows: int, steps: int, mode: str
) -> dict[str, dict[str, float]]:
    state = Rows(lib, compiled, orders, rows)
    bitmask = torch.full((rows, (lib.vocab_size + 31) // 32), -1, dtype=torch.int32)
    halves = [range(0, rows // 2), range(rows // 2, rows)]
    pool = ThreadPoolExecutor(2) if mode == "2 py threads" else None
    batch = mode.startswith("batch")
    if batch:
        lib.set_threads(int(mode.removeprefix("batch x")))

    def fill_rows(part: range) -> None:
        for r in part:
            lib.fill(state.matchers[r], bitmask, r)

    fill_wall, fill_cpu, accept_wall = [], [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter(), time.process_time()
        if batch:
            lib.fill_batch(state.matchers, bitmask)
        elif pool is not None:
            list(pool.map(fill_rows, halves))
        else:
            fill_rows(range(rows))
        fill_wall.append(time.perf_counter() - w0)
        fill_cpu.append(time.process_time() - c0)
        state.check(bitmask)
        tokens = state.next_tokens()
        w0 = time.perf_counter()
        if batch:
            lib.accept_batch(state.matchers, tokens)
        else:
            for m, t in zip(state.matchers, tokens, strict=True):
                lib.accept(m, t)
        accept_wall.append(time.perf_counter() - w0)
        state.advance()
    if pool is not None:
        pool.shutdown()
    return {"fill": summary(fill_wall), "cpu": summary(fill_cpu), "accept": summary(accept_wall)}


def gil_lag(fn: Callable[[], Any], seconds: float) -> tuple[float, float, float]:
    """The main thread's wake-up lag (p99, max, in ms) from 1 ms sleeps while another thread
    repeats `fn`, and `fn`'s mean duration (ms)."""
    stop = threading.Event()
    calls: list[float] = []

    def background() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            fn()
            calls.append(time.perf_counter() - t)

    thread = threading.Thread(target=background)
    thread.start()
    lags = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        time.sleep(0.001)
        lags.append(time.perf_counter() - t - 0.001)
    stop.set()
    thread.join()
    s = summary(lags)
    return s["p99"] / 1e3, s["max"] / 1e3, sum(calls) / max(1, len(calls)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizers", default="smollm2,llama3-like")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--single-steps", type=int, default=600)
    parser.add_argument("--batch-threads", default="1,2", help="comma-separated thread counts")
    args = parser.parse_args()
    print(machine_line())
    print(versions())
    for name in args.tokenizers.split(","):
        tokenizer, vocab_size = load_tokenizer(name)
        orders = [order_tokens(tokenizer, seed, 2 + seed % 4) for seed in range(NUM_ORDERS)]
        mean_len = sum(map(len, orders)) / len(orders)
        print(f"\n== tokenizer {name}: {vocab_size} tokens; orders of {mean_len:.0f} tokens")
        print(f"{'library':10s} {'rows':>4s} {'mode':12s} {'fill mean':>9s} {'p50':>8s} "
              f"{'p99':>8s} {'max':>8s} {'cpu mean':>9s} {'accept mean':>11s} {'p99':>8s}"
              "   (us per step)")  # fmt: skip
        libs = [XGrammar(tokenizer, vocab_size), LLGuidance(tokenizer, vocab_size)]
        compiled = {lib.name: lib.compile("json_schema", ORDER_SCHEMA) for lib in libs}
        for lib in libs:  # warm: walk every order once
            for order in orders:
                m = lib.matcher(compiled[lib.name])
                bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
                for t in order:
                    lib.fill(m, bitmask, 0)
                    lib.accept(m, t)
        modes = ["serial"] + [f"batch x{n}" for n in args.batch_threads.split(",")]
        plan = [(1, "serial", args.single_steps)] + [
            (args.rows, mode, args.steps) for mode in [*modes, "2 py threads"]
        ]
        for lib in libs:
            for rows, mode, steps in plan:
                r = run_mode(lib, compiled[lib.name], orders, rows, steps, mode)
                accept_mode = "batch" if mode.startswith("batch") else "loop"
                print(
                    f"{lib.name:10s} {rows:4d} {mode:12s} {r['fill']['mean']:9.1f} "
                    f"{r['fill']['p50']:8.1f} {r['fill']['p99']:8.1f} {r['fill']['max']:8.1f} "
                    f"{r['cpu']['mean']:9.1f} {r['accept']['mean']:11.1f} "
                    f"{r['accept']['p99']:8.1f}   (accept: {accept_mode})",
                    flush=True,
                )

        for lib in libs:
            lib.set_threads(int(args.batch_threads.split(",")[-1]))
        gil_probes(libs, compiled, orders, args.rows, vocab_size)


def gil_probes(
    libs: list[Any], compiled: dict[str, Any], orders: list[list[int]], rows: int, vocab: int
) -> None:
    print("\nGIL probe: main thread's lag waking from 1 ms sleeps while a thread repeats a call")
    print(f"{'call':52s} {'call ms':>8s} {'lag p99 ms':>10s} {'lag max ms':>10s}")
    bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)
    backtrack = re.compile(r"(a+)+$")
    probes: list[tuple[str, Callable[[], Any]]] = [
        ("nothing (time.sleep(0.01))", lambda: time.sleep(0.01)),
        ("python re (a+)+$ on 'a'*20+'b' (holds the GIL)", lambda: backtrack.match("a" * 20 + "b")),
    ]
    for lib in libs:
        state = Rows(lib, compiled[lib.name], orders, rows)
        probes.append(
            (f"{lib.name} batch fill {rows} rows",
             lambda lib=lib, state=state: lib.fill_batch(state.matchers, bitmask))
        )  # fmt: skip
        probes.append(
            (f"{lib.name} compile order schema (uncached)", lambda lib=lib: fresh_compile(lib))
        )
    for label, fn in probes:
        p99, worst, call_ms = gil_lag(fn, 1.5)
        print(f"{label:52s} {call_ms:8.2f} {p99:10.2f} {worst:10.2f}", flush=True)


def fresh_compile(lib: Any) -> Any:
    if isinstance(lib, XGrammar):
        lib.compiler.clear_cache()
    return lib.compile("json_schema", ORDER_SCHEMA)


if __name__ == "__main__":
    main()
