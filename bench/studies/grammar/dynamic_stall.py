"""Where xgrammar's `enable_dynamic_compilation` puts a hostile schema's cost: the compile of
hostile.py's "200 KB: 2.5k optional properties" case returns quickly, and the cost reappears in
the mask fills of the decode steps (where one slow fill stalls every row of the batch).

    timeout 300 /tmp/gvenv/bin/python bench/studies/grammar/dynamic_stall.py \
        | tee bench/studies/grammar/dynamic_stall.txt

It compiles the schema with dynamic compilation on, then fills and accepts along the first
tokens of an allowed prefix, printing each fill's time as it goes (so a run cut short by
`timeout` still shows how far it got). SmolLM2's tokenizer.
"""

from __future__ import annotations

import time

import torch
from hostile import ABANDONED, CASES, WIDE
from workload import XGrammar, load_tokenizer, machine_line, versions


def main() -> None:
    print(machine_line())
    print(versions())
    tokenizer, vocab_size = load_tokenizer("smollm2")
    lib = XGrammar(tokenizer, vocab_size, cache=False, dynamic=True)
    kind, make, _ = CASES[ABANDONED]
    start = time.perf_counter()
    compiled = lib.compile(kind, make())
    print(f"{ABANDONED}: compiled in {time.perf_counter() - start:.2f} s (dynamic compilation)")
    matcher = lib.matcher(compiled)
    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for n, token in enumerate(tokenizer.encode(WIDE, add_special_tokens=False)):
        start = time.perf_counter()
        lib.fill(matcher, bitmask, 0)
        took = time.perf_counter() - start
        print(f"fill {n:2d} before {tokenizer.decode([token])!r:14s} {took * 1e3:10.1f} ms",
              flush=True)  # fmt: skip
        assert lib.accept(matcher, token)


if __name__ == "__main__":
    main()
