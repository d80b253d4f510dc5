"""Token sampling from logits, per request: greedy, temperature, top-k, top-p, seed.

Greedy rows take the argmax. Other rows are scaled by their temperature, masked by their top-k and
top-p, and drawn from the remaining distribution. A request with a seed draws from its own
`torch.Generator`, created on its first draw and kept on the request, so its samples do not depend
on the rest of the batch or on preemption. The sampler never mutates the logits it is given, and
`sample` never waits for the device: its tokens stay there until the caller copies them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvrail.kernels import dispatch
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.staging import to_device


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k (0 = off) and top-p nucleus.

    The nucleus keeps the smallest set of most likely tokens whose probability reaches top_p; the
    most likely token is always kept. Returns a new tensor.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(-1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(-1)
    drop[:, 0] = False
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked_sorted)


class Sampler:
    """Samples one token per row of `logits` for the matching request.

    Apart from one draw per seeded row (each from its own generator), the tensor operations per
    step do not grow with the batch: one argmax over every row, the sampled rows scaled together
    (top-k/top-p only on the rows that set them) and one draw for all rows without a seed.
    """

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The tokens as an int64 tensor on the logits' device, one per row."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        chosen = dispatch.argmax(logits)  # exact in any dtype
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if rows:
            index = _on(logits.device, rows, np.int64)
            chosen[index] = _draw(logits.index_select(0, index), [requests[i] for i in rows])
        return chosen


def _on(device: torch.device, values: Sequence[float], dtype: type) -> torch.Tensor:
    return to_device(np.asarray(values, dtype=dtype), device)


def _draw(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """One token id per row, drawn from the row's logits scaled by its request's temperature
    and masked by its top-k and top-p."""
    params = [r.sampling_params for r in requests]
    device = logits.device
    temperature = _on(device, [p.temperature for p in params], np.float32)
    scaled = logits.float() / temperature.unsqueeze(-1)
    masked = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if masked:
        index = _on(device, masked, np.int64)
        top_k = _on(device, [params[j].top_k for j in masked], np.int64)
        top_p = _on(device, [params[j].top_p for j in masked], np.float32)
        scaled[index] = apply_top_k_top_p(scaled[index], top_k, top_p)
    probs = scaled.softmax(dim=-1)
    drawn = torch.empty(len(params), dtype=torch.int64, device=device)
    unseeded = [j for j, p in enumerate(params) if p.seed is None]
    if unseeded:
        index = _on(device, unseeded, np.int64)
        drawn[index] = torch.multinomial(probs[index], 1).squeeze(1)
    seeded = [j for j, p in enumerate(params) if p.seed is not None]
    if seeded:
        tokens = [
            torch.multinomial(probs[j], 1, generator=_generator(requests[j], device))
            for j in seeded
        ]
        drawn[_on(device, seeded, np.int64)] = torch.cat(tokens)
    return drawn


def _generator(request: Request, device: torch.device) -> torch.Generator | None:
    seed = request.sampling_params.seed
    if seed is None:
        return None
    if request.generator is None:
        request.generator = torch.Generator(device=device).manual_seed(seed)
    generator: torch.Generator = request.generator
    return generator
