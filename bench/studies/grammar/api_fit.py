"""How each library fits kvrail's engine: rebuilding a request's grammar state by replaying its
tokens (the prefill -> decode handoff, a restarted decode worker), rollback, forking,
serialization, jump-forward, and applying the bitmask to logits on the CPU.

    /tmp/gvenv/bin/python bench/studies/grammar/api_fit.py \
        | tee bench/studies/grammar/api_fit.txt

The grammar is the nested order json_schema; the output replayed is one long valid order
(1,000 tokens of it). Times are medians of 7 runs. The apply part times, on float32 logits of
1 and 256 rows: xgrammar's `apply_token_bitmask_inplace` (its `cpu` native kernel and its
`torch_native` backend), llguidance's `llguidance.torch.apply_token_bitmask_inplace`
(`torch.compile`d: its first call compiles), and a plain torch unpack + `masked_fill_` written
here as a reference; all four must agree. torch runs on `--torch-threads` threads (default 1:
with CI on the other core, two OpenMP threads wait on each other and the times scatter).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from workload import (
    ORDER_SCHEMA,
    LLGuidance,
    XGrammar,
    load_tokenizer,
    machine_line,
    order_tokens,
    versions,
)

REPS = 7


def median_ms(fn: Callable[[], Any], reps: int = REPS) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def replay(lib: Any, compiled: Any, tokens: list[int], one_call: bool) -> Any:
    matcher = lib.matcher(compiled)
    if one_call:
        assert lib.accept_many(matcher, tokens)
    else:
        for t in tokens:
            assert lib.accept(matcher, t)
    return matcher


def mask_at(lib: Any, matcher: Any) -> torch.Tensor:
    bitmask = torch.full((1, (lib.vocab_size + 31) // 32), -1, dtype=torch.int32)
    lib.fill(matcher, bitmask, 0)
    return bitmask


def state_part(lib: Any, compiled: Any, tokens: list[int]) -> None:
    n = len(tokens)
    print(f"\n-- {lib.name}: rebuilding state from (grammar, tokens so far), ms")
    print(f"new matcher from the cached grammar: {median_ms(lambda: lib.matcher(compiled)):.3f}")
    for k in (1, 100, n):
        loop = median_ms(lambda k=k: replay(lib, compiled, tokens[:k], one_call=False))
        line = f"replay {k:5d} tokens: per-token calls {loop:8.3f}"
        if lib.name == "llguidance":
            one = median_ms(lambda k=k: replay(lib, compiled, tokens[:k], one_call=True))
            line += f"   one consume_tokens call {one:8.3f}"
        print(line)

    matcher = replay(lib, compiled, tokens, one_call=False)
    print(f"fork/deep_copy at {n} tokens: {median_ms(lambda: lib.fork(matcher)):.3f}")
    checks = []
    for k in (1, 10, 100):
        reference = mask_at(lib, replay(lib, compiled, tokens[: n - k], one_call=False))
        m = replay(lib, compiled, tokens, one_call=False)
        start = time.perf_counter()
        lib.rollback(m, k)
        took = (time.perf_counter() - start) * 1e3
        same = torch.equal(mask_at(lib, m), reference)
        checks.append(f"rollback {k}: {took:.3f} ms, mask as before: {same}")
    print("; ".join(checks))
    try:
        pickle.dumps(matcher)
        print("pickle a matcher: works")
    except Exception as exc:
        print(f"pickle a matcher: {type(exc).__name__}: {str(exc)[:100]}")
    if lib.name == "xgrammar":
        text = compiled.serialize_json()
        start = time.perf_counter()
        again = type(compiled).deserialize_json(text, lib.info)
        took = (time.perf_counter() - start) * 1e3
        same = torch.equal(mask_at(lib, lib.matcher(again)), mask_at(lib, lib.matcher(compiled)))
        print(f"CompiledGrammar.serialize_json: {len(text) / 1e6:.2f} MB; deserialize "
              f"{took:.1f} ms; same first mask: {same}")  # fmt: skip
        print(f"jump-forward at start: {lib.matcher(compiled).find_jump_forward_string()!r}")
    else:
        print(f"jump-forward at start: {lib.matcher(compiled).compute_ff_bytes()!r}")


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Unpack the int32 words into bits, then mask the logits where a bit is 0."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(bits == 0, float("-inf"))


def apply_part(vocab_size: int, bitmask_rows: Callable[[int], torch.Tensor]) -> None:
    import llguidance.torch
    import xgrammar as xgr

    print("\n-- applying the bitmask to float32 logits on the CPU, us per call (median)")
    for rows in (1, 256):
        bitmask = bitmask_rows(rows)
        base = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(0))
        ways: dict[str, Callable[[torch.Tensor], None]] = {
            "xgrammar cpu": lambda x, b=bitmask: xgr.apply_token_bitmask_inplace(
                x, b, backend="cpu"
            ),
            "xgrammar torch_native": lambda x, b=bitmask: xgr.apply_token_bitmask_inplace(
                x, b, backend="torch_native"
            ),
            "llguidance.torch (torch.compile)": lambda x, b=bitmask: (
                llguidance.torch.apply_token_bitmask_inplace(x, b)
            ),
            "plain torch reference": lambda x, b=bitmask: reference_apply(x, b),
        }
        expected = base.clone()
        reference_apply(expected, bitmask)
        for name, way in ways.items():
            x = base.clone()
            start = time.perf_counter()
            way(x)
            first = time.perf_counter() - start
            assert torch.equal(x, expected), name
            copies = [base.clone() for _ in range(REPS)]
            it = iter(copies)
            per_call = median_ms(lambda way=way, it=it: way(next(it))) * 1e3
            print(f"{rows:3d} rows  {name:34s} {per_call:9.1f}   (first call {first:.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizers", default="smollm2,llama3-like")
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    print(machine_line())
    print(versions(), f"; torch threads: {torch.get_num_threads()}")
    for name in args.tokenizers.split(","):
        tokenizer, vocab_size = load_tokenizer(name)
        long_order = order_tokens(tokenizer, seed=7, num_items=30)
        tokens = long_order[:1000]
        print(f"\n== tokenizer {name}: {vocab_size} tokens; replaying {len(tokens)} tokens")
        libs = [XGrammar(tokenizer, vocab_size), LLGuidance(tokenizer, vocab_size)]
        for lib in libs:
            state_part(lib, lib.compile("json_schema", ORDER_SCHEMA), tokens)

        xgr = libs[0]
        compiled = xgr.compile("json_schema", ORDER_SCHEMA)

        def bitmask_rows(
            rows: int, xgr: Any = xgr, compiled: Any = compiled, tokens: list[int] = tokens
        ) -> torch.Tensor:
            bitmask = torch.full((rows, (xgr.vocab_size + 31) // 32), -1, dtype=torch.int32)
            for r in range(rows):  # rows at different points of the order
                m = replay(xgr, compiled, tokens[: (r * 37) % 900], one_call=False)
                xgr.fill(m, bitmask, r)
            return bitmask

        apply_part(vocab_size, bitmask_rows)


if __name__ == "__main__":
    main()
