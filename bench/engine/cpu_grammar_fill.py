"""The engine's grammar mask fill on the CPU, per step, at a real vocabulary (no model).

`MaskFiller.fill` (what a step with constrained rows runs on the host while the device runs its
forward: llguidance's threads filling one bitmask row per constrained request, the hold-backs,
the buffer) over N requests under `grammar_workload.ORDER_SCHEMA`, compiled as gpu_grammar.py
does, each walking the tokens of a different valid order as a model would emit them
(`json.dumps`), `Grammars.advance` after every step as the scheduler does; N = 1, 16, 64 and
256. Each N walks the schema as it is (`bounded`) and with every `maxLength` dropped
(`unbounded`: what its strings' bounds cost llguidance), over the same orders. Prints the wall
time of one fill on the calling thread and the process CPU time it took (every thread), mean
and p99 over the steps, and the advance's mean.

    .venv/bin/python -P bench/engine/cpu_grammar_fill.py | tee bench/engine/cpu_grammar_fill.txt

`--tokenizer DIR` measures another tokenizer (default: SmolLM2-135M's, 49,152 tokens; e.g. the
128k stand-in of gpu_grammar.py's docstring); `--threads N` sets llguidance's fill threads (0:
its default, 80% of the CPUs), and as in the engine a grammar gets as many independently
compiled starts (`Grammars.lineages`; `--lineages 1`: one).
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_grammar
import grammar_workload


def make_order(rng: random.Random) -> dict[str, Any]:
    """A valid instance of `grammar_workload.ORDER_SCHEMA` (keys in the schema's order)."""
    words = ["Anna", "Marsh", "Lane", "Oak", "Paris", "Berlin", "river", "blue", "lamp", "kit"]

    def text(limit: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))[:limit]

    items = [
        {"sku": f"ABC-{rng.randrange(10_000):04d}", "name": text(60),
         "quantity": rng.randint(1, 99), "unit_price": round(rng.uniform(0, 10_000), 2)}
        for _ in range(rng.randint(1, 4))
    ]  # fmt: skip
    address = {"street": text(80), "city": text(40), "postcode": f"{rng.randrange(10**5):05d}",
               "country": rng.choice(["DE", "FR", "GB", "US", "JP"])}  # fmt: skip
    return {
        "order_id": rng.randint(1, 10**6),
        "status": rng.choice(["pending", "paid", "shipped", "delivered", "cancelled"]),
        "customer": {"name": text(60), "email": "anna@example.com", "address": address},
        "items": items,
        "note": text(200) if rng.random() < 0.5 else None,
    }


def walk(
    grammars: Any, tokenizer: Any, schema: Any, rows: int, seed: int, threads: int
) -> dict[str, Any]:
    """Fill and advance `rows` requests through their orders' tokens, step by step."""
    import torch
    from llguidance import LLMatcher

    from kvrail.sampling import SamplingParams
    from kvrail.worker.engine.grammar_masks import MaskFiller
    from kvrail.worker.engine.request import Request, RequestStatus

    grammar = LLMatcher.grammar_from_json_schema(schema)
    params = SamplingParams(max_tokens=4096, grammar=grammar)
    rng = random.Random(seed)
    texts = [json.dumps(make_order(rng)) for _ in range(rows)]
    tokens = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    requests = [Request(f"w{i}", [1], params, num_in_flight=1) for i in range(rows)]
    for _ in requests:
        grammars.check(grammar)  # as the scheduler does as each request is added
    filler = MaskFiller(grammars, torch.device("cpu"), threads)
    times: dict[str, list[float]] = {"wall": [], "cpu": [], "advance": []}
    for step in range(max(len(t) for t in tokens)):
        live = [r for r, t in zip(requests, tokens, strict=True) if step < len(t)]
        wall, cpu = time.perf_counter(), time.process_time()
        filler.fill(live)
        times["wall"].append(time.perf_counter() - wall)
        times["cpu"].append(time.process_time() - cpu)
        started = time.perf_counter()
        for request, ids in zip(requests, tokens, strict=True):
            if step < len(ids):
                request.output_token_ids.append(ids[step])
                status = grammars.advance(request, None)
                assert status in (None, RequestStatus.FINISHED_STOPPED), "not a valid walk"
        times["advance"].append(time.perf_counter() - started)
    return times


def unbounded(schema: Any) -> Any:
    """`schema` with every `maxLength` dropped."""
    if isinstance(schema, dict):
        return {k: unbounded(v) for k, v in schema.items() if k != "maxLength"}
    if isinstance(schema, list):
        return [unbounded(v) for v in schema]
    return schema


def _ms(values: list[float]) -> str:
    return f"{1e3 * statistics.mean(values):.3f} / {1e3 * gpu_grammar.p99(values):.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--lineages", type=int, default=0, help="0: the fill's threads")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    args = parser.parse_args()
    from kvrail.worker.engine.grammar import Grammars, fill_threads

    tokenizer = gpu_grammar.load_tokenizer(args.tokenizer)
    started = time.perf_counter()
    lineages = args.lineages or fill_threads(args.threads)
    grammars = Grammars.from_hf(tokenizer, tokenizer.eos_token_id, len(tokenizer), lineages)
    print(f"# {len(tokenizer)} tokens; LLTokenizer built in {time.perf_counter() - started:.2f} s;"
          f" {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; threads "
          f"{args.threads or 'llguidance default'}; {lineages} starts per grammar")  # fmt: skip
    print("rows  schema     steps   fill wall mean / p99 (ms)   fill CPU mean / p99 (ms)   "
          "advance mean (ms)")  # fmt: skip
    schemas = {"bounded": grammar_workload.ORDER_SCHEMA,
               "unbounded": unbounded(grammar_workload.ORDER_SCHEMA)}  # fmt: skip
    for rows in args.rows:
        for name, schema in schemas.items():
            t = walk(grammars, tokenizer, schema, rows, seed=rows, threads=args.threads)
            wall, cpu = _ms(t["wall"]), _ms(t["cpu"])
            advance = 1e3 * statistics.mean(t["advance"])
            print(f"{rows:4}  {name:9} {len(t['wall']):6}   {wall:>26}   {cpu:>24}   "
                  f"{advance:17.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
