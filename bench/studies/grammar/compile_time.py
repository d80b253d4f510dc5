"""What a request's grammar costs before its first token, per library: compile (uncached and
cached), the first mask, and the first and second pass of mask fills through a valid output.

    /tmp/gvenv/bin/python bench/studies/grammar/compile_time.py \
        | tee bench/studies/grammar/compile_time.txt

For each tokenizer (SmolLM2's 49,152 tokens; the synthetic Llama-3-like 128,256) and each
request kind (json_object, the nested order json_schema, a date-time regex, a 4-way choice, a
small SQL grammar):
Three rows per case: xgrammar as vLLM runs it (masks precomputed at compile), `xgrammar-dyn`
(its `enable_dynamic_compilation`: masks built when first needed), llguidance.
- `prepare`: once per model (xgrammar `TokenizerInfo`, llguidance `LLTokenizer`);
- `compile, uncached`: xgrammar `compile_*` on a compiler with its cache off; llguidance
  `grammar_from_*` plus `LLMatcher(...)` (it has no separate compiled object: a matcher at the
  start state is what one caches);
- `cached`: xgrammar's compiler cache hit plus `GrammarMatcher(...)`; llguidance `deep_copy()`
  of the cached start-state matcher;
- `1st mask`: the first `fill` on a new matcher (llguidance builds its lexer lazily here);
- `pass 1` / `pass 2`: the mean fill per token over the sample output, on the first matcher of
  a compiled grammar and then on a second one (warm lexer / caches).
Medians of `--reps` runs; xgrammar compiles with 2 threads (this VM's cores). A CI run shares
the cores, so besides the compile's wall time its CPU time (`cpu`: the process's, all threads)
is shown, and the mask columns are CPU times (a preempted fill does not count the wait).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from workload import (
    Case,
    LLGuidance,
    XGrammar,
    allowed,
    cases,
    cpu_timed,
    load_tokenizer,
    machine_line,
    versions,
)


def walk(lib: Any, matcher: Any, tokens: list[int], bitmask: torch.Tensor) -> float:
    """Fill and accept through `tokens`; the mean fill CPU time in seconds. Checks every token
    is allowed by the mask and accepted."""
    fills = []
    for token in tokens:
        _, cpu, _ = cpu_timed(lambda: lib.fill(matcher, bitmask, 0))
        fills.append(cpu)
        assert allowed(bitmask, 0, token), (lib.name, token)
        assert lib.accept(matcher, token), (lib.name, token)
    assert lib.finished(matcher), lib.name
    return statistics.fmean(fills)


def measure(lib: Any, uncached: Any, case: Case, tokens: list[int], reps: int) -> dict[str, Any]:
    kind, spec = case.kind, case.spec
    bitmask = torch.full((1, (lib.vocab_size + 31) // 32), -1, dtype=torch.int32)
    compile_s, compile_cpu_s, first_mask_s = [], [], []
    for _ in range(reps):
        t, cpu, compiled = cpu_timed(lambda: uncached.compile(kind, spec))
        compile_s.append(t)
        compile_cpu_s.append(cpu)
        matcher = uncached.matcher(compiled)
        _, cpu, _ = cpu_timed(lambda: uncached.fill(matcher, bitmask, 0))  # noqa: B023
        first_mask_s.append(cpu)
    compiled = lib.compile(kind, spec)  # fills the cache (xgrammar); the prototype (llguidance)
    cached_s = []
    for _ in range(reps):
        start = time.perf_counter()
        matcher = lib.matcher(lib.compile(kind, spec) if isinstance(lib, XGrammar) else compiled)
        cached_s.append(time.perf_counter() - start)
    pass1 = walk(lib, lib.matcher(compiled), tokens, bitmask)
    pass2 = walk(lib, lib.matcher(compiled), tokens, bitmask)
    size = compiled.memory_size_bytes if isinstance(lib, XGrammar) else None
    return {
        "compile": statistics.median(compile_s) * 1e3,
        "compile_cpu": statistics.median(compile_cpu_s) * 1e3,
        "cached": statistics.median(cached_s) * 1e3,
        "first_mask": statistics.median(first_mask_s) * 1e3,
        "pass1": pass1 * 1e6,
        "pass2": pass2 * 1e6,
        "size": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizers", default="smollm2,llama3-like")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    print(versions())
    for name in args.tokenizers.split(","):
        tokenizer, vocab_size = load_tokenizer(name)
        print(f"\n== tokenizer {name}: {vocab_size} tokens")
        xgr_cached = XGrammar(tokenizer, vocab_size)
        xgr_uncached = XGrammar(tokenizer, vocab_size, cache=False)
        dyn_cached = XGrammar(tokenizer, vocab_size, dynamic=True)
        dyn_uncached = XGrammar(tokenizer, vocab_size, cache=False, dynamic=True)
        llg = LLGuidance(tokenizer, vocab_size)
        print(f"prepare (once per model): xgrammar TokenizerInfo {xgr_cached.prepare_s:.2f} s, "
              f"llguidance LLTokenizer {llg.prepare_s:.2f} s")  # fmt: skip
        print(
            f"{'case':22s} {'library':12s} {'tokens':>6s} {'compile ms':>10s} {'(cpu)':>7s} "
            f"{'cached ms':>9s} {'1st mask ms':>11s} {'pass1 us/tok':>12s} "
            f"{'pass2 us/tok':>12s} {'compiled size':>13s}"
        )
        extra = Case("grammar (SQL, Lark)", "lark", cases()[-1].spec["lark"], cases()[-1].sample)
        for case in [*cases(), extra]:
            tokens = tokenizer.encode(case.sample, add_special_tokens=False)
            tokens.append(tokenizer.eos_token_id)
            pairs = [(xgr_cached, xgr_uncached), (dyn_cached, dyn_uncached)]
            if case.kind != "lark":  # Lark is llguidance's own grammar row above
                pairs.append((llg, llg))
            for lib, uncached in pairs:
                r = measure(lib, uncached, case, tokens, args.reps)
                size = f"{r['size'] / 1024:.0f} KiB" if r["size"] is not None else "-"
                print(
                    f"{case.name:22s} {lib.name:12s} {len(tokens):6d} {r['compile']:10.2f} "
                    f"{r['compile_cpu']:7.1f} {r['cached']:9.3f} {r['first_mask']:11.3f} "
                    f"{r['pass1']:12.1f} {r['pass2']:12.1f} {size:>13s}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
