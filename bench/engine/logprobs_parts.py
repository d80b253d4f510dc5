"""Where a step's logprobs go (issue 46): the parts of `Sampler.logprobs` and its way back to the
host, timed apart at the engine's shape (256 rows, Llama-3's 128,256-token vocabulary, bf16
logits), with the real functions and no model.

Device parts (CUDA events, median of 50): the log-softmax, the chosen tokens' gather, the top-k
over the float32 log-probabilities and over the raw logits, and `Sampler.logprobs` whole, for
k = 0 and k = 5. Host parts (perf_counter, median of 200):
`Sampler.logprobs` plus `to_host` (the launches only, each on an idle device) and
`StepLogprobs.for_rows` plus `request_output` once the copies are on the host (the work
`step()` does on the engine thread after a step's event).

  python3 -P bench/engine/logprobs_parts.py   # on the lent GPU, or on the CPU (host parts)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvrail.worker.engine.request import Request, request_output
from kvrail.worker.engine.sampler import Sampler, StepLogprobs
from kvrail.worker.testing import make_request

ROWS, VOCAB = 256, 128256


def device_ms(fn: Callable[[], object], repeat: int = 50) -> float:
    """Median device time of `fn` in ms (CUDA events around each call)."""
    times = []
    for _ in range(repeat + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[5:])


def host_us(
    fn: Callable[[], object], repeat: int = 200, before: Callable[[], object] = lambda: None
) -> float:
    """Median host time of `fn` in microseconds (`before` runs untimed ahead of each call)."""
    times = []
    for _ in range(repeat + 10):
        before()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times[10:]) * 1e6


def host_parts(
    sampler: Sampler,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    requests: list[Request],
    token_ids: list[int],
) -> str:
    """The host's share of one step's logprobs for `requests`: the launches (each call on an
    idle device, so that they do not wait for the queue; a GPU only) and the records made once
    the copies are on the host."""
    cuda = logits.device.type == "cuda"

    def launch() -> object:
        step = sampler.logprobs(logits, requests, tokens)
        return step.to_host() if step is not None else None

    step = launch()
    assert isinstance(step, StepLogprobs)
    if cuda:
        torch.cuda.synchronize()

    def resolve() -> object:
        by_id = step.for_rows(requests, token_ids)
        return [request_output(r, by_id.get(r.request_id)) for r in requests]

    launched = host_us(launch, before=torch.cuda.synchronize) if cuda else float("nan")
    return f"launch + to_host {launched:8.1f}   for_rows + outputs {host_us(resolve):8.1f}"


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    logits = (torch.randn(ROWS, VOCAB, device=device) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (ROWS,), device=device)
    sampler = Sampler()
    print(f"# {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}; {ROWS} rows x {VOCAB}")  # fmt: skip
    if device.type == "cuda":
        as_float = logits.float()
        logprobs = torch.log_softmax(as_float, dim=-1)
        parts: dict[str, Callable[[], object]] = {
            "logits.float()": lambda: logits.float(),
            "log_softmax(float)": lambda: torch.log_softmax(as_float, dim=-1),
            "gather chosen": lambda: logprobs.gather(1, tokens.unsqueeze(1)),
            "topk(0) float32": lambda: logprobs.topk(0, dim=-1),
            "topk(5) float32": lambda: logprobs.topk(5, dim=-1),
            "topk(5) bf16 logits": lambda: logits.topk(5, dim=-1),
            "logsumexp(float)": lambda: torch.logsumexp(as_float, dim=-1),
            "max(float)": lambda: as_float.max(dim=-1),
            "argmax bf16": lambda: logits.argmax(dim=-1),
        }
        print("\n## device ms per step")
        for name, fn in parts.items():
            print(f"{name:24} {device_ms(fn):8.3f}")
        for k in (0, 5):
            requests = [make_request(4, logprobs=k) for _ in range(ROWS)]
            ms = device_ms(lambda r=requests: sampler.logprobs(logits, r, tokens))
            print(f"{'Sampler.logprobs k=' + str(k):24} {ms:8.3f}")
    print("\n## host us per step")
    token_ids = tokens.tolist()
    for k in (0, 5):
        requests = [make_request(4, logprobs=k) for _ in range(ROWS)]
        for request in requests:
            request.output_token_ids.append(11)
        print(f"k={k}: {host_parts(sampler, logits, tokens, requests, token_ids)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
