"""Log-probabilities of given tokens: the one computation behind a sampled token's logprobs
(`Sampler.logprobs`) and a prompt's scores (`SamplingParams.prompt_logprobs`).

A prompt is scored while it is prefilled: the hidden state at prompt position p gives the
log-probability of prompt token p + 1. `model_runner.prepare_step` picks those rows of a step
(`ScoreRows`, with the `ScoredSpan` of each request on the host), `ModelRunner.run` turns them
into logits a slice at a time (a whole chunk's logits at once would take prompt tokens x vocabulary
floats) and keeps only each row's entry and top-k (`PromptScores`, on the device), and the step
pipeline, once the step's event has passed, appends them to their requests in prompt order
(`PromptScores.apply`); the request's first output carries them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrail.outputs import TokenLogprobs
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.staging import to_host

SCORE_SLICE_ROWS = 1024
"""Prompt rows turned into logits at once: bounds the scores' device memory per step."""


def token_scores(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row: the log-softmax (float32) entry of its token in `tokens`, and its `k` most
    likely token ids and their log-probabilities (most likely first).

    The top-k runs over the raw `logits`, not the float32 log-probabilities: a row's
    log-softmax never reorders it (x - max - log-sum, the same constant for every entry, rounded),
    so its k largest logits are its k most likely tokens, and their entries are gathered from the
    same log-softmax. The values are those of a top-k over the log-probabilities, bit for bit;
    only which of equal values comes first may differ, as a top-k leaves it open. In bf16 the
    top-k reads half the bytes: `Sampler.logprobs` of 256 rows of 128,256 tokens at k = 5 took
    0.74 ms of an H100 a step instead of 0.91 (bench/engine/logprobs_parts.txt)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_ids = logits.topk(k, dim=-1).indices
    return chosen, top_ids, logprobs.gather(1, top_ids)


@dataclass(frozen=True, slots=True)
class ScoreRows:
    """The rows of a step's hidden states that score prompt tokens, on every rank: `rows` into
    the hidden states, the prompt token each scores (`targets`), and the top-k to keep (`k`, the
    most any of their requests asked)."""

    rows: np.ndarray  # int64 [m]
    targets: np.ndarray  # int64 [m]
    k: int


@dataclass(frozen=True, slots=True)
class ScoredSpan:
    """Consecutive score rows of one request: prompt tokens `first` to `first + count - 1`."""

    request: Request
    first: int
    count: int


@dataclass(frozen=True, slots=True)
class PromptScores:
    """A step's prompt scores, row by row (see `ScoreRows`), with the spans they belong to; on
    the device until `to_host`."""

    spans: Sequence[ScoredSpan]
    targets: np.ndarray
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to_host(self) -> PromptScores:
        """The same, copied into pinned host memory without waiting (read them once the step's
        event has passed)."""
        return PromptScores(
            self.spans, self.targets, to_host(self.chosen), to_host(self.top_ids),
            to_host(self.top_logprobs),
        )  # fmt: skip

    def apply(self) -> None:
        """Append each span's scores to its request, trimmed to what it asked. A span that does
        not continue its request's scores (a finished request, a prompt scored already) is
        dropped."""
        chosen = self.chosen.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        targets = self.targets.tolist()
        row = 0
        for span in self.spans:
            request, start = span.request, row
            row += span.count
            if request.is_finished or span.first != request.num_prompt_scored + 1:
                continue
            k = request.sampling_params.prompt_logprobs or 0
            request.prompt_logprobs.extend(
                TokenLogprobs(
                    targets[i], chosen[i], tuple(top_ids[i][:k]), tuple(top_logprobs[i][:k])
                )
                for i in range(start, row)
            )
            request.num_prompt_scored += span.count


def score_rows(
    items: Sequence[tuple[int, int, Request, int]],
) -> tuple[ScoreRows | None, list[ScoredSpan]]:
    """The score rows of a step's scheduled chunks: each item is (the chunk's first row in the
    hidden states, its first position, its request, its number of tokens). A chunk scores the
    prompt tokens after its positions that its request asks for and has not scored yet."""
    rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    spans: list[ScoredSpan] = []
    k = 0
    for row, start, request, num_new in items:
        params = request.sampling_params
        if params.prompt_logprobs is None:
            continue
        first = max(start, request.num_prompt_scored)  # a position scores the token after it
        end = min(start + num_new, request.num_prompt_tokens - 1)
        if first >= end:
            continue
        rows.append(np.arange(row + first - start, row + end - start, dtype=np.int64))
        targets.append(np.asarray(request.prompt_token_ids[first + 1 : end + 1], dtype=np.int64))
        spans.append(ScoredSpan(request, first + 1, end - first))
        k = max(k, params.prompt_logprobs)
    if not spans:
        return None, []
    return ScoreRows(np.concatenate(rows), np.concatenate(targets), k), spans
