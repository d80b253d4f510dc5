"""Where a decode step's time goes once requests are served: the engine alone vs the engine
driven by `EngineService` with a decode worker's per-token work (Llama-3-8B shape, random bf16).

The H200 chat sweeps (bench/sweep/README.md) saw a decode worker's time per token grow to 45-50 ms
at about 80 running requests, where `profile_gpu.py` measured 6.9 ms per decode step at batch 32.
This splits that gap. For each batch size N, N requests (512 prompt tokens, greedy, no EOS) are
prefilled, then timed while every one of them decodes:

- `engine`: `LLMEngine.step()` called in a loop (no service, no callbacks): ms per step;
- `service`: the same engine run by `EngineService`'s thread, each request's updates taken on
  the event loop by a callback that builds and encodes a `TokenEvent`, as the decode role does
  before publishing it (NATS itself is left out): the median gap between one request's updates,
  and (`running`) the median number of requests still unfinished when those gaps were taken.

    source hack/device-env.sh && python3 -P bench/engine/gpu_service_step.py
    .venv/bin/python -P bench/engine/gpu_service_step.py --smoke      # CPU, tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvrail.testing.scripts import load_script

HERE = Path(__file__).resolve().parent
base: Any = load_script("kvrail_bench_engine_gpu_llama3_8b", HERE / "gpu_llama3_8b.py")

DECODE_STEPS = 40


def prefill_all(engine: Any, n: int, params: Any, tag: str) -> list[Any]:
    requests = [
        engine.add_request(f"{tag}-{i}", p, params)
        for i, p in enumerate(base.prompts(n, 512, seed=n))
    ]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    return requests  # every one has decode steps left: max_tokens leaves room for the timing


def engine_step_ms(engine: Any, n: int, params: Any) -> float:
    prefill_all(engine, n, params, f"e{n}")
    # No sync before the clock starts: with async scheduling the next step is already queued,
    # and waiting for it here would leave one of the timed steps out.
    started = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    base.sync()
    ms = (time.perf_counter() - started) * 1000 / DECODE_STEPS
    while engine.has_unfinished_requests():
        engine.step()
    return ms


async def service_gap_ms(engine: Any, n: int, params: Any) -> tuple[float, float]:
    """The median gap between one request's updates, and the median number of unfinished
    requests when those gaps were taken."""
    from kvrail.outputs import RequestOutput, TokenEvent
    from kvrail.worker.service import EngineService

    loop = asyncio.get_running_loop()
    service = EngineService(engine, loop).start()
    gaps: list[float] = []
    running: list[int] = []  # unfinished requests at each gap
    last: dict[str, float] = {}
    sent: dict[str, int] = {}
    done = asyncio.Event()
    finished = 0
    all_started = float("inf")  # when the last request got its first token: pure decode after

    def on_update(update: RequestOutput) -> None:  # what the decode role does, minus publishing
        nonlocal finished, all_started
        now = time.perf_counter()
        rid = update.request_id
        seq = sent.get(rid, 0)
        sent[rid] = seq + 1
        TokenEvent(update, seq, "w").encode()
        if len(sent) == n and all_started == float("inf"):
            all_started = now
        if last.get(rid, 0.0) >= all_started and not update.is_last:
            gaps.append(now - last[rid])
            running.append(n - finished)
        last[rid] = now
        if update.is_last:
            finished += 1
            if finished == n:
                done.set()

    try:
        # All at once: the engine thread runs every queued command before its next step. One
        # submit after another would wait a step each, and early requests would finish before
        # late ones started (the first version of this script did that: at N = 160 it timed
        # gaps with a median of 44 requests running).
        await asyncio.gather(
            *(
                service.submit(f"s{n}-{i}", prompt, params, on_update)
                for i, prompt in enumerate(base.prompts(n, 512, seed=n))
            )
        )
        await asyncio.wait_for(done.wait(), 600)
    finally:
        await service.close()
    return statistics.median(gaps) * 1000, statistics.median(running)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--sizes", default="32,80,160")
    args = parser.parse_args()
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from kvrail.sampling import SamplingParams

    if args.smoke:
        base.DEVICE = "cpu"
        base.LLAMA3_8B.update(base.SMOKE)
    torch.manual_seed(0)
    config = LlamaConfig(**base.LLAMA3_8B)
    dtype = torch.bfloat16 if base.DEVICE == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(base.DEVICE):
        hf = HFLlama(config).eval()
    torch.set_default_dtype(previous)
    engine = base.build_engine(hf, config, 0.2 if args.smoke else 40.0, graphs=not args.smoke)
    del hf
    params = SamplingParams(max_tokens=DECODE_STEPS + 24, ignore_eos=True)
    engine.generate(base.prompts(4, 64, 9), SamplingParams(max_tokens=8, ignore_eos=True))
    name = torch.cuda.get_device_name() if base.DEVICE == "cuda" else "CPU smoke run"
    print(f"# {name}, torch {torch.__version__}; {DECODE_STEPS} decode steps per size")
    print(f"{'N':>5} {'engine ms/step':>15} {'service ms/token':>17} {'running':>8}")
    for n in (int(s) for s in args.sizes.split(",")):
        engine_ms = engine_step_ms(engine, n, params)
        service_ms, running = asyncio.run(service_gap_ms(engine, n, params))
        print(f"{n:5d} {engine_ms:15.2f} {service_ms:17.2f} {running:8.0f}", flush=True)


if __name__ == "__main__":
    main()
