"""The OpenAI API at kvrail's edge: log-probabilities, from the engine's `TokenLogprobs`
(`kvrail.outputs`, one per sampled token) to a choice's `logprobs`.

- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}, ...]}` (the whole body adds `"refusal": null`); `top_logprobs` holds the
  request's `top_logprobs` most likely tokens, most likely first;
- completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, four lists with
  one item per token; an item of `top_logprobs` maps the text of the request's `logprobs` most
  likely tokens, and of the sampled one, to their log-probabilities (so up to `logprobs` + 1,
  as OpenAI documents); `text_offset` is where each token starts in the returned text. With
  `echo`, the prompt's tokens come first, the first of them with null for its log-probability
  and its top entries (nothing precedes it).

A token is named by its text as the tokenizer decodes it alone, special tokens included (a
function of its id, `TextCodec.token_text`, which keeps each id's text); a token that holds
only part of a character's UTF-8 bytes decodes to U+FFFD, as in vLLM. `bytes` is that text's
UTF-8 encoding. A log-probability JSON cannot state (minus infinity) is written `MIN_LOGPROB`,
as vLLM writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrail.outputs import TokenLogprobs

TokenText = Callable[[int], str]
"""The text that names a token id (`TextCodec.token_text`)."""
MIN_LOGPROB = -9999.0


def _value(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB  # NaN too: never invalid JSON


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode())}


def chat_content(logprobs: Sequence[TokenLogprobs], token_text: TokenText) -> list[dict[str, Any]]:
    """The `content` entries of a chat choice's `logprobs` for these tokens, in order."""
    out: list[dict[str, Any]] = []
    for lp in logprobs:
        entry = _chat_entry(token_text(lp.token_id), lp.logprob)
        entry["top_logprobs"] = [
            _chat_entry(token_text(t), v)
            for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        ]
        out.append(entry)
    return out


def completion_lists(
    logprobs: Sequence[TokenLogprobs], token_text: TokenText, text_offset: int
) -> dict[str, Any]:
    """A completion choice's `logprobs` for these tokens, the first starting at `text_offset`
    and each next one where the text of the one before it ends."""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for lp in logprobs:
        text = token_text(lp.token_id)
        top: dict[str, float] = {}
        for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
            top.setdefault(token_text(t), _value(v))  # two ids of one text: the likelier
        if lp.token_id not in lp.top_token_ids:
            top.setdefault(text, _value(lp.logprob))
        tokens.append(text)
        values.append(_value(lp.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


@dataclass(slots=True)
class ResponseLogprobs:
    """One response's logprobs, piece by piece (`of`), and joined for the whole body (`join`).

    A completion token's `text_offset` counts from where its piece's text starts in the
    returned text (what the pieces before it returned), plus the texts of the piece's tokens
    before it: exact whenever a piece's tokens decode alone to its text, and never off by more
    than one piece otherwise (a character split over tokens, text held back for a stop string).
    """

    is_chat: bool
    token_text: TokenText
    text_offset: int = 0
    """Characters of the response's text before the next piece."""

    def of(
        self, logprobs: Sequence[TokenLogprobs], text: str, echo: Sequence[int] = (),
        prompt: Sequence[TokenLogprobs] = (),
    ) -> dict[str, Any] | None:  # fmt: skip
        """The `logprobs` of the choice of a piece with these tokens and `text` (None when it
        has no tokens); the next piece's text starts after `text`. A completion's piece that
        echoes the prompt names its first token (`echo`, which has no log-probability: null,
        as in OpenAI's API) and its `prompt` scores, listed before the piece's tokens."""
        offset = self.text_offset
        self.text_offset += len(text)
        if not logprobs and not echo:
            return None
        if self.is_chat:
            return {"content": chat_content(logprobs, self.token_text)}
        if not echo:
            return completion_lists(logprobs, self.token_text, offset)
        first = self.token_text(echo[0])
        lists = completion_lists([*prompt, *logprobs], self.token_text, offset + len(first))
        lists["tokens"].insert(0, first)
        lists["token_logprobs"].insert(0, None)
        lists["top_logprobs"].insert(0, None)
        lists["text_offset"].insert(0, offset)
        return lists

    def join(self, parts: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
        """A whole body's `logprobs`: the pieces' (`of`), in order."""
        present = [p for p in parts if p is not None]
        if self.is_chat:
            return {"content": [e for p in present for e in p["content"]], "refusal": None}
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {key: [item for p in present for item in p[key]] for key in keys}
