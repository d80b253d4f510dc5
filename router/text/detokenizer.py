"""Incremental detokenization with stop strings: a request's output tokens turned into text as
they arrive, one `Detokenizer` per request.

Pure Python over a `decode` callable (the tokenizer's, from
`kvrail.router.text.tokenizer.TextCodec`), so like the rest of the router it never imports torch
(an import-linter contract).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class Detokenizer:
    """Turns a request's output tokens into text as they arrive (one instance per request).

    `feed()` returns only text that is final: it holds back an incomplete UTF-8 character (a
    byte-level BPE token can end mid-character, which decodes to U+FFFD until the rest arrives)
    and any tail that could be the start of a stop string. Decoding uses a window of tokens
    (vLLM's prefix/read offsets), so the cost of a feed does not grow with the output length
    (only while the text keeps ending in an undecodable byte does the window grow), and stop
    strings are matched by automata, in time linear in the text whatever their length.

    Guarantees: the concatenation of every `feed()` and `flush()` equals `decode(output ids)`
    cut before the first stop string to complete (the earliest end; of several ending there,
    the longest); nothing after a stop string is ever returned; `stopped` turns True when one
    completes; after that, `feed()` and `flush()` return "". The decode of the last prompt
    tokens is the left context of the first output token (tokenizers that strip a leading space
    at the start of a text would otherwise lose it), unless it ends mid-character. With
    `min_tokens`, stop strings apply only to the text of the tokens fed after the first
    `min_tokens` (a stop string that began earlier and ends later is not found).
    """

    CONTEXT_TOKENS = 5

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        prompt_ids: Sequence[int],
        stop: Sequence[str],
        min_tokens: int = 0,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._min_tokens = min_tokens
        self._num_fed = 0
        self._decode = decode
        context = list(prompt_ids[-self.CONTEXT_TOKENS :])
        if context and decode(context).endswith("\ufffd"):
            context = []
        self._ids = context
        self._read_offset = len(context)
        self._matcher = _StopMatcher(stop) if stop else None
        self._pending = ""  # final text held back because it may start a stop string
        self._parts: list[str] = []
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """All text returned so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def feed(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the new text that is safe to emit (maybe "")."""
        if self.stopped or not token_ids:
            return ""
        self._ids.extend(token_ids)
        self._num_fed += len(token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    @property
    def has_stop_strings(self) -> bool:
        return self._matcher is not None

    def feed_each(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """`feed` the tokens one at a time: the new text, and how many of `token_ids` were fed,
        up to the one that completed a stop string (all of them if none did)."""
        parts: list[str] = []
        for i, token_id in enumerate(token_ids):
            parts.append(self.feed((token_id,)))
            if self.stopped:
                return "".join(parts), i + 1
        return "".join(parts), len(token_ids)

    def flush(self) -> str:
        """At the end of the output: everything still held back ("" once stopped)."""
        if self.stopped:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        # The window `_ids` is [prefix tokens, already emitted | unread tokens from _read_offset].
        ids, read = self._ids, self._read_offset
        if read == len(ids):
            return ""
        prefix_text = self._decode(ids[:read])
        text = self._decode(ids)
        if len(text) <= len(prefix_text) or (text.endswith("\ufffd") and not final):
            return ""  # nothing visible yet, or a character is incomplete: wait for more
        # The tokens just read become the prefix (left context) of the next ones.
        del ids[:read]
        self._read_offset = len(ids)
        return text[len(prefix_text) :]

    def _emit(self, new: str, final: bool) -> str:
        if self._matcher is None or self._num_fed <= self._min_tokens:
            out = new
        else:
            hit = self._matcher.scan(new)
            if hit is not None:
                end, stop = hit
                held = self._pending + new[:end]
                out = held[: len(held) - len(stop)]
                self.stopped, self.stop_string, self._pending = True, stop, ""
            else:
                held = self._pending + new
                keep = 0 if final else self._matcher.num_held_chars
                out, self._pending = held[: len(held) - keep], held[len(held) - keep :]
        if out:
            self._parts.append(out)
        return out


class _StopMatcher:
    """Finds stop strings in a stream of text fed in pieces, in time linear in the text: one
    Knuth-Morris-Pratt automaton per stop string, whose state is the length of the longest
    suffix of the stream so far that is a prefix of that string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(dict.fromkeys(stops))
        self._fail = [_failure(s) for s in self.stops]
        self._states = [0] * len(self.stops)

    @property
    def num_held_chars(self) -> int:
        """How many trailing characters could still be the start of a stop string."""
        return max(self._states)

    def scan(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`. On the first completed stop string return (index in `text` just
        past it, the stop string); of several completing at one character, the longest."""
        states = self._states
        for i, c in enumerate(text):
            best: str | None = None
            for j, stop in enumerate(self.stops):
                k = states[j]
                while k and stop[k] != c:
                    k = self._fail[j][k - 1]
                if stop[k] == c:
                    k += 1
                if k == len(stop):
                    if best is None or len(stop) > len(best):
                        best = stop
                    k = self._fail[j][k - 1]
                states[j] = k
            if best is not None:
                return i + 1, best
        return None


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper prefix of s[: i + 1] that is
    also its suffix."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f
