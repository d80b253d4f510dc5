"""What a grammar (`SamplingParams.grammar`, structured outputs) costs the engine: Llama-3-8B
shape, random bf16 weights, a 128k-token vocabulary; `vllm_grammar.py` runs vLLM on the same
workload in the same command.

256 concurrent requests of 512 random prompt tokens and at most 128 output tokens, greedy:
unconstrained (`ignore_eos`) against constrained by `grammar_workload.ORDER_SCHEMA` (a nested
order: `$defs`/`$ref`, an array of objects, enums, bounded numbers, a pattern, a nullable field,
`additionalProperties: false`), compiled with llguidance's defaults (flexible whitespace, as
vLLM's). A constrained answer ends where the schema does (the end-of-sequence token is allowed
there) or at 128 tokens, so tokens/s counts the tokens each answer got. Each mode runs once
untimed, then twice in the order a, b, a, b (`gpu_llama3_8b.alternate`), new prompts every run.
Printed:
- output tokens/s of both, and their ratio (the issue's target: constrained >= 0.9x);
- how many constrained answers ended with the schema complete, and whether each of those parses
  (`json.loads`) and validates (`jsonschema`); the others stopped at 128 tokens;
- per step with constrained rows, the mask fill on the host (`MaskFiller.fill`: llguidance's
  threads, the hold-backs, the copy queued): its wall time on the engine thread and the process
  CPU time it took (every thread), mean and p99, and the engine's own histogram's mean
  (`kvrail_grammar_mask_fill_seconds`);
- whether the fill hid behind the forward pass: CUDA events recorded as the fill starts and as it
  ends (after its copy is queued) time, on the device, how long the GPU waited for it past the
  forward's end (0 when the forward was still running when the masks were queued); mean, p99
  and the share of steps that waited more than 50 us.

The schema's strings are bounded (`maxLength`), which makes llguidance's masks dearer: walking
this schema with the engine's own fill on the development VM's one fill thread, 256 rows at 128k
tokens cost 9.3 ms a step (p99 54 ms), 2.7 ms (p99 9 ms) with the bounds dropped
(bench/engine/cpu_grammar_fill.txt). The GPU host's threads (`--grammar-threads`, default
llguidance's: 80% of the CPUs) are what hide it behind the forward.

The tokenizer: Llama 3's cannot be downloaded here, so the grammar study's same-sized stand-in is
used (128,256 tokens, byte-level BPE, Llama 3's split and specials; `<|end_of_text|>` is the
end of sequence). Build it on the development machine under build/ (ignored by git) and carry
it to the device:

  .venv/bin/python -P bench/studies/grammar/llama3_like_tokenizer.py --out build/gtok/llama3-like

then, on the lent GPU (device `run` with `carry: ["build/gtok"]`, from the repository root):

  source hack/device-env.sh && python3 -P bench/engine/gpu_grammar.py \\
      --tokenizer build/gtok/llama3-like | tee bench/engine/gpu_grammar.txt

`--smoke` runs a tiny model on the CPU, with SmolLM2's tokenizer unless `--tokenizer` is given,
to check this script end to end.
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


def run(engine: Any, n: int, length: int, params: Any) -> tuple[float, list[Any]]:
    """Seconds to run `n` new prompts of `length` tokens with `params` to completion, and the
    engine's requests (new prompts each run, so that none is served from the prefix cache)."""
    batch = base.prompts(n, length, seed=next(_SEEDS))
    base.sync()
    started = time.perf_counter()
    requests = [engine.add_request(f"g{started}-{i}", p, params) for i, p in enumerate(batch)]
    while engine.has_unfinished_requests():
        engine.step()
    base.sync()
    return time.perf_counter() - started, requests


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
    import grammar_workload
    import jsonschema
    from llguidance import LLMatcher

    from kvrail.sampling import SamplingParams
    from kvrail.worker.engine.request import RequestStatus

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
    schema = grammar_workload.ORDER_SCHEMA
    grammar = LLMatcher.grammar_from_json_schema(schema)
    n, prompt, out = (256, 512, 128) if not args.smoke else (8, 32, 128)
    modes = {
        "none": SamplingParams(max_tokens=out, ignore_eos=True),
        "json_schema": SamplingParams(max_tokens=out, grammar=grammar),
    }
    times = FillTimes(engine)
    counts = {"runs": 0, "complete": 0, "invalid": 0}
    tokens: dict[str, list[int]] = {mode: [] for mode in modes}

    def measure(mode: str) -> float:
        seconds, requests = run(engine, n, prompt, modes[mode])
        got = sum(r.num_output_tokens for r in requests)
        tokens[mode].append(got)
        if mode == "json_schema":
            counts["runs"] += 1
            for request in requests:
                if request.status is not RequestStatus.FINISHED_STOPPED:
                    continue  # stopped at `out` tokens, the JSON unfinished
                counts["complete"] += 1
                try:
                    text = tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
                    jsonschema.validate(json.loads(text), schema)
                except (ValueError, jsonschema.ValidationError):
                    counts["invalid"] += 1
        return got / seconds

    values = base.alternate(dict.fromkeys(modes, True), measure)
    waits = times.waits_s()  # every event has passed: each run ends with a synchronize
    print(f"\n## kvrail: {n} requests of {prompt} prompt / <= {out} output tokens: output "
          f"tokens/s, twice (tokens per run)")  # fmt: skip
    for mode, runs in values.items():
        ratio = sum(runs) / sum(values["none"])
        got = " ".join(
            f"{v:10.0f} ({t} tokens)" for v, t in zip(runs, tokens[mode][1:], strict=True)
        )
        print(f"{mode:12} {got}   {ratio:.3f}x none")
    print(
        f"constrained answers complete: {counts['complete']} of {counts['runs'] * n} (the "
        f"others stopped at {out} tokens); not valid JSON of the schema: {counts['invalid']}"
    )
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
