"""Token sampling from logits, per request (`kvrail.sampling.SamplingParams`).

Rows are first adjusted where their request asks for it: its `logit_bias` added, the
end-of-sequence token and the stop token ids masked while `min_tokens` is not reached, the
repetition, presence and frequency penalties applied over the request's tokens so far, and last
the tokens its grammar forbids masked (`TokenMasks`, filled by `grammar_masks.MaskFiller`: a
grammar row's end-of-sequence and stop token ids are held back in its mask instead, so that the
grammar wins where it allows nothing else; see `kvrail.worker.engine.grammar`). Then
greedy rows take the argmax; the others are scaled by their temperature, masked by their top-k,
top-p and min-p, and drawn from what remains. A request with a seed draws each token by an
exponential race (`_race`) over noise that is a hash of a key and the token id, the key made of
the request's seed and the token's position in the output (`draw_seed`): its samples depend
neither on the rest of the batch nor on preemption, nor on which worker drew its earlier tokens
(after a remote prefill the decode worker draws the second token from the same seed as a
colocated worker would, with nothing but the first token crossing the handoff), nor on the
device: the hash is integer arithmetic. Every seeded row of a step is drawn in the same few
tensor operations (a draw per row from its own generator ran 256 seeded rows at 0.57x greedy's
tokens/s on an H100: bench/engine/gpu_choices.txt).

Per-request sampler state is therefore a function of what both sides of a handoff know (the
request's parameters and its output so far); every output token, sampled here or installed from
a remote prefill, joins the request through `Scheduler._append_token`, which is where such state
advances.
The sampler never mutates the logits it is given, and `sample` never waits for the device: its
tokens stay there until the caller copies them.

A penalized row needs the request's whole token history: the scheduler does not schedule such a
request ahead of its previous token (`Scheduler.schedule_ahead`), so the history is complete. A
grammar row needs it too, but is scheduled ahead all the same: its mask is filled only once the
previous step's tokens are known, while the device runs its forward pass (`step_pipeline`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrail.kernels import dispatch
from kvrail.outputs import TokenLogprobs
from kvrail.worker.engine.grammar_masks import TokenMasks
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.scores import token_scores
from kvrail.worker.engine.staging import to_device, to_host


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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask the tokens whose probability is below `min_p` times the row's highest (0 = off)."""
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p.unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: Sequence[float],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> torch.Tensor:
    """Penalized float32 logits, one row per request (vLLM's definitions): the repetition penalty
    over the tokens of the prompt and the output, presence and frequency over the output."""
    rows, vocab = logits.shape
    device = logits.device
    out = logits.float().clone()
    output_counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
    for i in range(rows):
        if output_ids[i]:
            ids = _on(device, output_ids[i], np.int64)
            output_counts[i].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        if prompt_ids[i]:
            seen[i, _on(device, prompt_ids[i], np.int64)] = True
    seen |= output_counts > 0
    rep = _on(device, repetition, np.float32).unsqueeze(-1)
    penalized = torch.where(out > 0, out / rep, out * rep)
    out = torch.where(seen, penalized, out)
    out -= _on(device, frequency, np.float32).unsqueeze(-1) * output_counts
    out -= _on(device, presence, np.float32).unsqueeze(-1) * (output_counts > 0).float()
    return out


@dataclass(frozen=True, slots=True)
class StepLogprobs:
    """The log-probabilities of one step's rows that asked (`rows`, indexes into the step's
    requests): each sampled token's, and the `k` most likely tokens (the most any of them asked)
    with theirs, on the device until copied to the host (`to_host`)."""

    rows: list[int]
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to_host(self) -> StepLogprobs:
        """The same, copied into pinned host memory without waiting (ordered on the stream:
        read them once the step's event has passed)."""
        return StepLogprobs(
            self.rows, to_host(self.chosen), to_host(self.top_ids), to_host(self.top_logprobs)
        )

    def for_rows(
        self, requests: Sequence[Request], token_ids: Sequence[int]
    ) -> dict[str, TokenLogprobs]:
        """Each asking row's `TokenLogprobs` (its sampled token from `token_ids`, one per row),
        trimmed to what its request asked, by request id; on the host."""
        chosen = self.chosen.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        out = {}
        for j, i in enumerate(self.rows):
            request = requests[i]
            k = request.sampling_params.logprobs or 0
            out[request.request_id] = TokenLogprobs(
                token_ids[i], chosen[j], tuple(top_ids[j][:k]), tuple(top_logprobs[j][:k])
            )
        return out


class Sampler:
    """Samples one token per row of `logits` for the matching request.

    Apart from one draw per seeded row (each from its own generator) and the rows that need an
    adjustment, the tensor operations per step do not grow with the batch: one argmax over every
    row, the sampled rows scaled together (top-k/top-p and min-p only on the rows that set them)
    and one draw for all rows without a seed.
    """

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id

    def logprobs(
        self, logits: torch.Tensor, requests: Sequence[Request], tokens: torch.Tensor
    ) -> StepLogprobs | None:
        """The log-probabilities of the rows whose request asks (`SamplingParams.logprobs`),
        None when none does (nothing is computed then): the model's log-softmax over the raw
        `logits` (before the request's sampling parameters), the sampled `tokens`' entries, and
        one top-k over the asking rows with k the most any of them asked. On the device."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return None
        k = max(requests[i].sampling_params.logprobs or 0 for i in rows)
        index = _on(logits.device, rows, np.int64)
        scored = token_scores(logits.index_select(0, index), tokens.index_select(0, index), k)
        return StepLogprobs(rows, *scored)

    def sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        masks: TokenMasks | None = None,
    ) -> torch.Tensor:
        """The tokens as an int64 tensor on the logits' device, one per row; the rows `masks`
        names only among the tokens their grammar allows."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        logits = self._adjusted(logits, requests, masks)
        chosen = dispatch.argmax(logits)  # exact in any dtype
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if rows:
            index = _on(logits.device, rows, np.int64)
            chosen[index] = _draw(logits.index_select(0, index), [requests[i] for i in rows])
        return chosen

    def _adjusted(
        self, logits: torch.Tensor, requests: Sequence[Request], masks: TokenMasks | None
    ) -> torch.Tensor:
        """`logits`, or a copy with the rows that mask stop tokens, apply penalties or follow a
        grammar changed."""
        masked = [i for i, r in enumerate(requests) if self._stop_ids_masked(r)]
        penalized = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        biased = [i for i, r in enumerate(requests) if r.sampling_params.logit_bias]
        if not masked and not penalized and not biased and masks is None:
            return logits
        out = logits.clone()
        if biased:
            bias_rows: list[int] = []
            bias_ids: list[int] = []
            biases: list[float] = []
            for i in biased:
                for entry in requests[i].sampling_params.logit_bias:
                    bias_rows.append(i)
                    bias_ids.append(entry.token_id)
                    biases.append(entry.bias)
            device = logits.device
            at = (_on(device, bias_rows, np.int64), _on(device, bias_ids, np.int64))
            out.index_put_(at, _on(device, biases, np.float32).to(out.dtype), accumulate=True)
        if penalized:
            params = [requests[i].sampling_params for i in penalized]
            index = _on(logits.device, penalized, np.int64)
            rows = apply_penalties(
                out.index_select(0, index),
                [requests[i].prompt_token_ids for i in penalized],
                [requests[i].output_token_ids for i in penalized],
                [p.repetition_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
            )
            out[index] = rows.to(out.dtype)
        for i in masked:
            sampling = requests[i].sampling_params
            ids = list(sampling.stop_token_ids)
            if not sampling.ignore_eos and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
            out[i, _on(logits.device, ids, np.int64)] = float("-inf")
        if masks is not None:
            dispatch.apply_token_bitmask(out, masks.bitmask, masks.rows)
        return out

    def _stop_ids_masked(self, request: Request) -> bool:
        params = request.sampling_params
        if params.grammar is not None:
            return False  # held back in its grammar mask (`Grammars.hold_back_ids`)
        # The row samples output token number `num_output_tokens + num_in_flight - 1` (0-based):
        # `num_in_flight` counts this step's token, and a step still on the device (async).
        if request.num_output_tokens + request.num_in_flight - 1 >= params.min_tokens:
            return False
        return bool(params.stop_token_ids) or (
            not params.ignore_eos and self.eos_token_id is not None
        )


def _on(device: torch.device, values: Sequence[float], dtype: type) -> torch.Tensor:
    return to_device(np.asarray(values, dtype=dtype), device)


def _draw(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """One token id per row, drawn from the row's logits scaled by its request's temperature
    and masked by its top-k, top-p and min-p."""
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
    with_min_p = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if with_min_p:
        index = _on(device, with_min_p, np.int64)
        min_p = _on(device, [params[j].min_p for j in with_min_p], np.float32)
        scaled[index] = apply_min_p(scaled[index], min_p)
    probs = _distribution(scaled, logits)
    drawn = torch.empty(len(params), dtype=torch.int64, device=device)
    unseeded = [j for j, p in enumerate(params) if p.seed is None]
    if unseeded:
        index = _on(device, unseeded, np.int64)
        drawn[index] = torch.multinomial(probs[index], 1).squeeze(1)
    seeded = [j for j, p in enumerate(params) if p.seed is not None]
    if seeded:
        keys = [_draw_key(requests[j]) for j in seeded]
        index = _on(device, seeded, np.int64)
        drawn[index] = _race(probs.index_select(0, index), keys)
    return drawn


_MASK_64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for output token `position` (0-based): SplitMix64's
    finalizer over the request's seed and the position, so neighbouring positions and seeds get
    unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)


def _draw_key(request: Request) -> int:
    """The key of a seeded request's draw for the token this row samples: output token number
    `num_output_tokens + num_in_flight - 1` (`num_in_flight` counts this step's token, and a
    step still on the device)."""
    seed = request.sampling_params.seed
    assert seed is not None
    return draw_seed(seed, request.num_output_tokens + request.num_in_flight - 1)


def _race(probs: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
    """One token per row of `probs`: the argmax of p / E, E an Exp(1) variable per token,
    picks token i with probability p_i (an exponential race); E is a pure function of the row's
    64-bit key and the token id (`kvrail.kernels.reference.race_scores`)."""
    device = probs.device
    key = np.asarray(keys, dtype=np.uint64)
    low = to_device((key & np.uint64(0xFFFFFFFF)).astype(np.int64), device)
    high = to_device((key >> np.uint64(32)).astype(np.int64), device)
    return dispatch.argmax(dispatch.race_scores(probs.float().contiguous(), low, high))


def _distribution(scaled: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Softmax of each row of `scaled` (`logits` over the temperature, masked). A row with no
    distribution (its scaled logits overflowed, as under a temperature or a repetition penalty
    near 0, or none is finite) becomes certain of its greedy token, the limit of a temperature
    going to 0, instead of failing every request of the step in `torch.multinomial`. On the
    device, without a host synchronisation."""
    probs = scaled.masked_fill(scaled.isnan(), float("-inf")).softmax(dim=-1)
    bad = (~torch.isfinite(probs).all(dim=-1) | ~(probs.sum(dim=-1) > 0)).unsqueeze(-1)
    greedy = logits.float().masked_fill(logits.isnan(), float("-inf")).argmax(dim=-1, keepdim=True)
    probs = torch.where(bad, torch.zeros_like(probs), probs)
    return probs.scatter(-1, greedy, torch.where(bad, 1.0, probs.gather(-1, greedy)))
