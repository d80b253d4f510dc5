"""Token sampling from logits, per request: greedy, temperature, top-k, top-p, seed.

Greedy rows take the argmax. Other rows are scaled by their temperature, masked by their top-k and
top-p, and drawn from the remaining distribution. A request with a seed draws from its own
`torch.Generator`, created on its first draw and kept on the request, so its samples do not depend
on the rest of the batch or on preemption. The sampler never mutates the logits it is given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrail.worker.engine.request import Request


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
    """Samples one token per row of `logits` for the matching request."""

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if not rows:  # all greedy: argmax on the device (exact in any dtype), one sync
            return logits.argmax(dim=-1).tolist()
        logits = logits.float()
        chosen = logits.argmax(dim=-1)
        params = [requests[i].sampling_params for i in rows]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        scaled = logits[rows] / temperature.unsqueeze(-1)
        probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
        for j, i in enumerate(rows):
            generator = _generator(requests[i], device)
            token = torch.multinomial(probs[j], 1, generator=generator)
            chosen[i] = token[0]
        return [int(t) for t in chosen.tolist()]


def _generator(request: Request, device: torch.device) -> torch.Generator | None:
    seed = request.sampling_params.seed
    if seed is None:
        return None
    if request.generator is None:
        request.generator = torch.Generator(device=device).manual_seed(seed)
    generator: torch.Generator = request.generator
    return generator
