"""Does llguidance's parallel mask fill scale over a host's cores, and what makes it scale?

A request's matcher is a `deep_copy` of its grammar's cached start-state matcher. Copies share
their start's lexer (its lazily built states), so every fill thread that masks a row of that
grammar works on the same lexer: one schema's 256 rows do not spread over 12 threads (the
2026-12-06 H100 run: 6.0 ms on 1 thread, 7.4 ms on 12; independently compiled matchers 3.5 ms).
This study fills the masks of `--rows` requests walking valid orders of
`grammar_workload.ORDER_SCHEMA` (as `bench/engine/cpu_grammar_fill.py` does) with `--threads`
llguidance threads, the rows' matchers copied from K independently compiled starts ("lineages";
request i copies start i mod K), with the rows handed to the fill in row order (lineages
interleaved) or grouped by lineage (so the contiguous runs the executor's threads take hold
mostly one lineage each). K = 1 is today's engine; K = rows is one compile per request.

Per case: the compiles' time, and the fill's wall time per step (mean and p99 over every step,
and mean over the steps after the first 20: the lexers are warm there) and its CPU time (the
process's, all threads).

    python3 -P bench/studies/grammar/lineages.py --tokenizer build/gtok/llama3-like --threads 12

(carry `build/gtok`, built by `bench/studies/grammar/llama3_like_tokenizer.py`; without
`--tokenizer`, SmolLM2's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ENGINE_BENCH = Path(__file__).resolve().parents[2] / "engine"
sys.path.insert(0, str(ENGINE_BENCH))
import cpu_grammar_fill  # noqa: E402
import gpu_grammar  # noqa: E402
import grammar_workload  # noqa: E402

WARM_STEP = 20


def run_case(grammars, tokens, grammar, threads, lineages, grouped, executor):
    import numpy as np
    from llguidance import LLMatcher
    from llguidance.numpy import fill_next_token_bitmask_par

    from kvrail.worker.engine.grammar import parser_limits

    rows = len(tokens)
    started = time.perf_counter()
    starts = [LLMatcher(grammars.tokenizer, grammar, log_level=0, limits=parser_limits())
              for _ in range(min(lineages, rows))]  # fmt: skip
    compile_s = time.perf_counter() - started
    matchers = [starts[i % len(starts)].deep_copy() for i in range(rows)]
    order = sorted(range(rows), key=lambda i: (i % len(starts), i)) if grouped else range(rows)
    bits = np.zeros((rows, grammars.num_words), dtype=np.int32)
    walls: list[float] = []
    cpus: list[float] = []
    for step in range(max(len(t) for t in tokens)):
        live = [(matchers[i], i) for i in order if step < len(tokens[i])]
        wall, cpu = time.perf_counter(), time.process_time()
        fill_next_token_bitmask_par(executor, live, bits)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        for matcher, ids in zip(matchers, tokens, strict=True):
            if step < len(ids):
                assert matcher.consume_token(ids[step]), "not a valid walk"
    p99 = sorted(walls)[int(0.99 * (len(walls) - 1))]
    warm = statistics.mean(walls[WARM_STEP:])
    return (f"{threads:7} {len(starts):8} {'grouped' if grouped else 'mixed':>7} "
            f"{1e3 * compile_s:10.1f} {1e3 * statistics.mean(walls):10.3f} {1e3 * p99:9.3f} "
            f"{1e3 * warm:10.3f} {1e3 * statistics.mean(cpus):9.3f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0])
    args = parser.parse_args()
    from llguidance import LLExecutor, LLMatcher

    from kvrail.worker.engine.grammar import Grammars

    tokenizer = gpu_grammar.load_tokenizer(args.tokenizer)
    grammars = Grammars.from_hf(tokenizer, tokenizer.eos_token_id, len(tokenizer))
    grammar = LLMatcher.grammar_from_json_schema(grammar_workload.ORDER_SCHEMA)
    rng = random.Random(1)
    texts = [json.dumps(cpu_grammar_fill.make_order(rng)) for _ in range(args.rows)]
    tokens = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    cpus = os.cpu_count() or 1
    print(f"# {len(tokenizer)} tokens, {args.rows} rows, {sum(map(len, tokens))} tokens walked;"
          f" {cpus} CPUs, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("threads lineages   rows  compile ms  fill mean      p99  warm mean  CPU mean  (ms)")
    for threads in args.threads:
        threads = threads or max(1, int(0.8 * cpus))
        executor = LLExecutor(threads)
        cases = [(1, False), (threads, False), (threads, True), (4 * threads, True),
                 (args.rows, False)]  # fmt: skip
        for lineages, grouped in dict.fromkeys(cases):
            print(run_case(grammars, tokens, grammar, threads, lineages, grouped, executor),
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
