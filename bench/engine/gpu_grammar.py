"""What a grammar (`SamplingParams.grammar`, structured outputs) costs the engine: Llama-3-8B
shape, random bf16 weights, a 128k-token vocabulary.

256 concurrent requests of 512 prompt tokens, each under a realistic nested `json_schema` (an
order: `$defs`/`$ref`, an array of objects, enums, bounded integers, patterns, a nullable
field, `additionalProperties: false`; strings bounded so that random weights end the JSON;
compact separators), against 256 prompts unconstrained that run to the output lengths of a
first constrained run (`ignore_eos`), so both have the same lengths. Alternated a, b, a, b after
one untimed run of each (`gpu_llama3_8b.alternate`). Printed:
- output tokens/s of both, and their ratio (the issue's target: constrained >= 0.9x);
- per step with constrained rows, the mask fill on the host (`MaskFiller.fill`: llguidance's
  threads, the hold-backs, the copy queued): its wall time on the engine thread and the process
  CPU time it took (every thread), mean and p99, and the engine's own histogram's mean
  (`kvrail_grammar_mask_fill_seconds`);
- whether the fill hid behind the forward pass: CUDA events recorded as the fill starts and as it
  ends (after its copy is queued) time, on the device, how long the GPU waited for it past the
  forward's end (0 when the forward was still running when the masks were queued); mean, p99
  and the share of steps that waited more than 50 us;
- the mean output length and every request's validity (each constrained output is parsed by
  `json.loads` and validated with `jsonschema`).

The bounds on the strings (`maxLength`, which random weights need to ever close a string) make
llguidance's masks about 6x as costly as the same schema without them (bench/engine/
cpu_grammar_fill.txt, at 64 rows and 49k tokens), so the fill measured here is pessimistic for
schemas without length bounds, as OpenAI's strict mode writes them. On the development VM's one
fill thread, 256 rows cost 38 ms a step at 128k tokens (p99 196 ms): the GPU host's threads
(`--grammar-threads`) are what hide it.

The tokenizer: Llama 3's cannot be downloaded here, so the grammar study's same-sized stand-in is
used (128,256 tokens, byte-level BPE, Llama 3's split and specials;
bench/studies/grammar/llama3_like_tokenizer.py trains it in about 40 s from local text). Build
it on the development machine into a folder the repository ignores, and carry it to the device:

  echo /.gtok/ >> .git/info/exclude
  .venv/bin/python -P bench/studies/grammar/llama3_like_tokenizer.py --out .gtok/llama3-like

then, on the lent GPU (device `run` with `carry: [".gtok"]`, from the repository root):

  source hack/device-env.sh && python3 -P bench/engine/gpu_grammar.py \\
      --tokenizer .gtok/llama3-like | tee bench/engine/gpu_grammar.txt

(the device has the same CPython and /usr/share/doc, so it could also train it there, in about
40 s of device time). `--grammar-threads N` sets llguidance's fill threads (0: its default, 80% of
the CPUs). `--smoke` runs a tiny model on the CPU, with SmolLM2's tokenizer unless `--tokenizer`
is given, to check this script end to end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_llama3_8b as base

_SEEDS = iter(range(300, 10_000))
_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 24},
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"type": "string", "enum": ["US", "CA", "GB", "DE", "FR"]},
    },
    "required": ["street", "city", "postal_code", "country"],
    "additionalProperties": False,
}
_ITEM = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "name": {"type": "string", "minLength": 1, "maxLength": 32},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
        "unit_price_cents": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
        "category": {"type": "string", "enum": ["book", "electronics", "grocery", "toy"]},
        "gift_wrap": {"type": "boolean"},
    },
    "required": ["sku", "name", "quantity", "unit_price_cents", "category"],
    "additionalProperties": False,
}
ORDER_SCHEMA: dict[str, Any] = {
    "title": "Order",
    "type": "object",
    "$defs": {"Address": _ADDRESS, "Item": _ITEM},
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{8}$"},
        "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 32},
                "email": {"type": "string", "maxLength": 40},
                "phone": {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]},
                "address": {"$ref": "#/$defs/Address"},
            },
            "required": ["name", "email", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {"$ref": "#/$defs/Item"},
            "minItems": 1,
            "maxItems": 3,
        },
        "notes": {"anyOf": [{"type": "string", "maxLength": 48}, {"type": "null"}]},
        "total_cents": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
    },
    "required": ["order_id", "status", "customer", "items", "total_cents"],
    "additionalProperties": False,
}


class FillTimes:
    """Wraps an engine's `MaskFiller.fill`: each fill's wall and process CPU seconds on the
    host, and CUDA events as it starts and ends (the GPU's wait for it, read after the run)."""

    def __init__(self, engine: Any) -> None:
        self.fill: Callable[[Any], Any] = engine.pipeline.masks.fill
        engine.pipeline.masks.fill = self
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.events: list[tuple[Any, Any]] = []

    def __call__(self, requests: Any) -> Any:
        start = end = None
        if base.DEVICE == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        wall, cpu = time.perf_counter(), time.process_time()
        masks = self.fill(requests)
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((start, end))
        return masks

    def waits_s(self) -> list[float]:
        """The GPU's wait for each fill past its forward pass (after a synchronize)."""
        return [start.elapsed_time(end) / 1e3 for start, end in self.events]


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))] if values else 0.0


def histogram_mean() -> float:
    from kvrail.worker import metrics

    samples = {s.name: s.value for m in metrics.GRAMMAR_MASK_FILL_SECONDS.collect()
               for s in m.samples}  # fmt: skip
    count = samples.get("kvrail_grammar_mask_fill_seconds_count", 0.0)
    return samples.get("kvrail_grammar_mask_fill_seconds_sum", 0.0) / count if count else 0.0


def run(engine: Any, batch: list[list[int]], params: list[Any]) -> tuple[float, list[list[int]]]:
    """Seconds to run `batch` with `params` (one each) to completion, and the outputs."""
    base.sync()
    started = time.perf_counter()
    requests = [
        engine.add_request(f"g{started}-{i}", p, sp)
        for i, (p, sp) in enumerate(zip(batch, params, strict=True))
    ]
    while engine.has_unfinished_requests():
        engine.step()
    base.sync()
    return time.perf_counter() - started, [r.output_token_ids for r in requests]


def load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    if path is None:
        from kvrail.model_files import resolve
        from kvrail.worker.models.loader import prepare

        return AutoTokenizer.from_pretrained(prepare(resolve("smollm2")))
    return AutoTokenizer.from_pretrained(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", help="a folder with tokenizer.json (see the docstring)")
    parser.add_argument("--grammar-threads", type=int, default=0)
    parser.add_argument("--kv-gib", type=float, default=40.0)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.tokenizer is None and not args.smoke:
        parser.error("--tokenizer is needed (a 128k-token one; see the docstring)")
    import jsonschema
    from llguidance import LLMatcher

    from kvrail.sampling import SamplingParams

    tokenizer = load_tokenizer(args.tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|end_of_text|>") if args.tokenizer else None
    eos = eos if isinstance(eos, int) and eos >= 0 else tokenizer.eos_token_id
    base.LLAMA3_8B["vocab_size"] = base.SMOKE["vocab_size"] = len(tokenizer)
    base.LLAMA3_8B["eos_token_id"] = base.SMOKE["eos_token_id"] = eos
    engine = base.bench_engine(
        args.smoke, args.kv_gib, tokenizer=tokenizer, eos_token_id=eos,
        grammar_threads=args.grammar_threads,
    )  # fmt: skip
    print(f"# tokenizer: {len(tokenizer)} tokens, eos {eos}; grammar threads "
          f"{args.grammar_threads or 'llguidance default'}")  # fmt: skip
    grammar = LLMatcher.grammar_from_json_schema(
        ORDER_SCHEMA, defaults={"whitespace_flexible": False}
    )
    n, prompt, cap = (256, 512, 512) if not args.smoke else (8, 32, 512)
    batch = base.prompts(n, prompt, seed=next(_SEEDS))
    constrained = [SamplingParams(max_tokens=cap, ignore_eos=True, grammar=grammar)] * n
    _, outputs = run(engine, batch, constrained)  # the lengths every later run repeats
    lengths = [len(o) for o in outputs]
    free = [SamplingParams(max_tokens=k, ignore_eos=True) for k in lengths]
    times = FillTimes(engine)
    invalid = 0

    def measure(mode: str) -> float:
        nonlocal invalid
        fresh = base.prompts(n, prompt, seed=next(_SEEDS))  # no prefix-cache hits
        params = constrained if mode == "json_schema" else free
        seconds, got = run(engine, fresh, params)
        if mode == "json_schema":
            for tokens in got:
                try:
                    text = tokenizer.decode(tokens, skip_special_tokens=True)
                    jsonschema.validate(json.loads(text), ORDER_SCHEMA)
                except (ValueError, jsonschema.ValidationError):
                    invalid += 1
        return sum(len(t) for t in got) / seconds

    values = base.alternate({"json_schema": True, "unconstrained": True}, measure)
    waits = times.waits_s()  # every event has passed: each run ends with a synchronize
    print(
        f"\n## {n} requests of {prompt} prompt tokens, outputs as long as the schema's "
        f"(a first constrained run's: mean {statistics.mean(lengths):.0f}, max "
        f"{max(lengths)} tokens; the unconstrained runs take those lengths): output tokens/s"
    )
    for mode, runs in values.items():
        ratio = sum(runs) / sum(values["unconstrained"])
        print(f"{mode:14} {base.fmt(runs, '.0f')}   {ratio:.3f}x unconstrained")
    print(f"constrained outputs that are not valid JSON of the schema: {invalid} "
          f"(of {3 * n}: the untimed run and two timed)")  # fmt: skip
    print(f"\n## mask fill per step with constrained rows ({len(times.wall)} fills, every run)")
    print(f"engine thread wall  mean {1e3 * statistics.mean(times.wall):7.3f} ms   "
          f"p99 {1e3 * p99(times.wall):7.3f} ms")  # fmt: skip
    print(f"process CPU         mean {1e3 * statistics.mean(times.cpu):7.3f} ms   "
          f"p99 {1e3 * p99(times.cpu):7.3f} ms   (all threads)")  # fmt: skip
    print(f"kvrail_grammar_mask_fill_seconds mean {1e3 * histogram_mean():.3f} ms")
    if waits:
        waited = sum(w > 50e-6 for w in waits) / len(waits)
        print(f"GPU wait past the forward  mean {1e3 * statistics.mean(waits):7.3f} ms   "
              f"p99 {1e3 * p99(waits):7.3f} ms   steps waiting > 50 us: {waited:.1%}")  # fmt: skip
    else:
        print("GPU wait past the forward: not measured (CPU run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
