"""The parts of a chat prompt: the template's own text between the message contents, and the
token ids of that text kept from one request to the next (`TemplateParts`).

`kvrail.router.text.tokenizer.TextCodec.chat_prompt` renders a conversation a second time with
each message's content replaced by a sentinel (`sentinel`), cuts that render at the sentinels
(`split_at`) and checks that joining the pieces with the real contents (`join`) gives the real
render; the text outside the contents (`outside`) is the template's, where only the template's
special tokens count. A template that reads a clock or draws random text
(`UNSTABLE_TEMPLATE_WORDS`) renders differently from one call to the next, so its sentinel
renders are not kept. Pure: no tokenizer here.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

_FIXED_PARTS = 256  # template-only prompt parts whose token ids a TextCodec keeps
_FIXED_PART_CHARS = 2048  # and their longest (a default system prompt is a few hundred)

# Words of a chat template whose render can change from one call to the next (transformers'
# clock global, Jinja's `random` filter and `lipsum` global): its sentinel renders are not kept.
UNSTABLE_TEMPLATE_WORDS = ("strftime_now", "random", "lipsum")


class TemplateParts:
    """Token ids of the chat prompt's parts that hold no message content: the template's own
    text between its special tokens (a default system prompt, "assistant\\n"), the same on
    every request. Bounded in count and length; emptied when full."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: dict[str, array[int]] = {}

    def get(self, part: str) -> Sequence[int] | None:
        """The ids kept for `part`, or None."""
        return self._ids.get(part)

    def keep(self, part: str, ids: Sequence[int]) -> None:
        """Remember a template-only part's ids: at most _FIXED_PARTS parts of at most
        _FIXED_PART_CHARS characters, their ids as 32-bit integers, so names or other fields a
        template renders outside the message contents cannot grow it past about 4 MiB.
        Tokenizer threads call this concurrently; each dict operation is atomic."""
        if len(part) > _FIXED_PART_CHARS:
            return
        if len(self._ids) >= _FIXED_PARTS:
            self._ids.clear()
        self._ids[part] = array("i", ids)

    def clear(self) -> None:
        self._ids.clear()

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[str]:
        """The parts kept (a snapshot, safe while other threads keep more)."""
        return iter(list(self._ids))


def outside(begin: int, end: int, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether text[begin:end] overlaps none of `spans` (the message contents)."""
    return not any(s < end and begin < e for s, e in spans)


def sentinel(index: int) -> str:
    """Stands for message `index`'s content in the sentinel render (private-use characters)."""
    return f"\ue000{index}\ue001"


def split_at(text: str, sentinels: Sequence[str]) -> list[str] | None:
    """`text` cut at each sentinel, in order (one more piece than sentinels), or None when a
    sentinel is missing or out of order (the template dropped or reordered a message)."""
    pieces: list[str] = []
    rest = text
    for mark in sentinels:
        before, found, rest = rest.partition(mark)
        if not found:
            return None
        pieces.append(before)
    pieces.append(rest)
    return pieces


def join(pieces: Sequence[str], contents: Sequence[str]) -> str:
    return "".join(p + c for p, c in zip(pieces, [*contents, ""], strict=True))
