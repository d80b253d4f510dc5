"""The router's text layer: a model's tokenizer, with its chat template and a detokenizer per
request (`TextCodec`).

Everything here runs on `tokenizers` and `jinja2` only; the router process never imports torch
(an import-linter contract). Where the tokenizer files come from is
`kvrail.router.text.tokenizer_files`.

The chat template is rendered as transformers renders it (`kvrail.router.text.chat_template`), so
`chat_prompt` equals transformers' `apply_chat_template(..., tokenize=True,
add_generation_prompt=True)` (with `tools`, and template variables such as `enable_thinking`,
when given), with one exception: text a client wrote never becomes a control token. Only the
template emits special tokens (`<|im_start|>`, `<|eot_id|>`, `[INST]`, ...); the same strings
inside a message or a completion prompt are encoded as plain text, unless the deployment trusts
its clients (`allow_special_tokens_in_prompts`). What a template renders outside the message
contents (tool definitions, the calls and ids of a tool conversation, names, variables) cannot
be told apart from the template's own text, so there a special token's text is refused. A
template that rewrites the content it inserts (e.g. `| trim`) cannot be encoded piecewise: such
a conversation is encoded whole, and refused if a message holds a special token's text.
Incremental detokenization with stop strings is `kvrail.router.text.detokenizer`.

Encoding runs `tokenizers`' batch call, which releases the GIL, so a caller may run it on a
thread while the event loop keeps serving; `at_least_tokens` bounds a text's token count from
its length alone (no token is longer than `max_token_bytes`), so a prompt that cannot fit is
refused without tokenizing it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from kvrail.errors import InvalidRequestError, ModelNotFoundError
from kvrail.model_files import resolve
from kvrail.router.text.chat_template import chat_template, compile_template, template_variables
from kvrail.router.text.detokenizer import Detokenizer
from kvrail.router.text.template_parts import (
    UNSTABLE_TEMPLATE_WORDS,
    TemplateParts,
    join,
    outside,
    sentinel,
    split_at,
)
from kvrail.router.text.tokenizer_files import read_json, token_content, tokenizer_dir

log = logging.getLogger(__name__)

_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TextCodec:
    """A model's tokenizer and chat template, safe to share between concurrent requests and
    tokenizer threads (the `tokenizers` Tokenizer is thread-safe for encode/decode). What
    changes after construction is only what it keeps to save work, each bounded: sentinel
    renders per role sequence, the token ids of the template's own text, and the text of each
    token id `token_text` was asked for (at most the vocabulary)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        served_name: str,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
        eos_token_ids: Sequence[int],
        fingerprint: str,
        directory: Path | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self.eos_token_ids = tuple(eos_token_ids)
        self.directory = directory
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._fingerprint = fingerprint
        self._template = compile_template(chat_template) if chat_template else None
        self.template_variables = (
            template_variables(chat_template) if chat_template else frozenset()
        )
        """The names the chat template reads (`tools`, `enable_thinking`, ...)."""
        # The sentinel render (`chat_prompt`) of a conversation without names depends on its
        # roles alone, unless the template reads a clock or draws random text.
        self._marked_by_roles: Callable[[tuple[str, ...]], str] | None = None
        if chat_template and not any(w in chat_template for w in UNSTABLE_TEMPLATE_WORDS):
            self._marked_by_roles = functools.lru_cache(maxsize=256)(self._render_marked)
        # The same tokenizer with special-token text encoded as text (for what clients wrote).
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        # Token ids of the template's own text, the same on every request (`_encode_outside`).
        self._fixed_parts = TemplateParts()
        self._token_texts: dict[int, str] = {}
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # A bound, not the exact figure: a byte-level token's characters take 1-2 UTF-8 bytes
        # each for the one byte they stand for, so this can only overstate a token's length.
        self.max_token_bytes = max((len(t.encode()) for t in vocab), default=1)
        specials = {
            t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        }
        self._special_texts = tuple(specials)
        self._special_ids = specials
        # Longest first, so a special token that extends another one wins (as the tokenizer's
        # own matching does).
        self._special_pattern = (
            re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
            if specials
            else None
        )

    @classmethod
    def load(cls, model: str, cache_dir: Path, template: str | None = None) -> TextCodec:
        """Resolve `model` (see `kvrail.model_files.resolve`) and load its tokenizer, converting a
        GGUF file once into the cache when no worker did; `template` replaces the model's chat
        template. Raises ModelNotFoundError."""
        started = time.monotonic()
        source = resolve(model)
        directory = tokenizer_dir(source, cache_dir)
        codec = cls.from_directory(directory, source.served_name, template)
        log.info(
            "tokenizer loaded name=%s path=%s vocab=%d seconds=%.2f",
            source.served_name,
            directory,
            codec.vocab_size,
            time.monotonic() - started,
        )
        return codec

    @classmethod
    def from_directory(
        cls, directory: Path, served_name: str, template: str | None = None
    ) -> TextCodec:
        """Load `tokenizer.json`, `tokenizer_config.json` and the chat template (unless
        `template` replaces it) from a directory laid out by transformers' `save_pretrained`."""
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelNotFoundError(f"no tokenizer.json in {directory}")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = read_json(directory / "special_tokens_map.json")
        config.update(read_json(directory / "tokenizer_config.json"))
        special = {k: t for k in _SPECIAL_TOKENS if (t := token_content(config.get(k)))}
        template = template or chat_template(directory, config)
        eos: list[int] = []
        if (
            "eos_token" in special
            and (tid := tokenizer.token_to_id(special["eos_token"])) is not None
        ):
            eos.append(tid)
        for name in ("generation_config.json", "config.json"):
            value = read_json(directory / name).get("eos_token_id")
            for tid in value if isinstance(value, list) else [value]:
                if isinstance(tid, int) and tid not in eos:
                    eos.append(tid)
        h = hashlib.sha256(tokenizer_file.read_bytes())
        h.update(b"\0" + (template or "").encode())
        fingerprint = "tokenizer-sha256:" + h.hexdigest()
        return cls(tokenizer, served_name, template, special, eos, fingerprint, directory)

    def fingerprint_id(self) -> str:
        """An identity of the tokenizer: sha256 of tokenizer.json and the chat template."""
        return self._fingerprint

    def at_least_tokens(self, num_bytes: int) -> int:
        """A lower bound on the tokens of any text of `num_bytes` UTF-8 bytes."""
        return -(-num_bytes // self.max_token_bytes)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer's own post-processor adds
        (none for SmolLM2), as transformers' `tokenizer(text)` gives them, except that special
        tokens written in `text` are plain text unless `allow_special`."""
        tokenizer = self.tokenizer if allow_special else self._plain
        return list(tokenizer.encode_batch_fast([text], add_special_tokens=True)[0].ids)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders `tools` (SmolLM2's ignores them)."""
        return "tools" in self.template_variables

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template applied to `messages` with `add_generation_prompt=True`, `tools`
        and the template `variables` given. A template that does not know the `developer` role
        sees it as `system`. Raises InvalidRequestError when the model has no template or the
        template rejects the conversation."""
        if self._template is None:
            raise InvalidRequestError(f"model {self.served_name} has no chat template")
        knows_developer = "developer" in (self.chat_template or "")
        chat = []
        for m in messages:
            item = {k: v for k, v in m.items() if v is not None or k == "content"}
            if item.get("role") == "developer" and not knows_developer:
                item["role"] = "system"
            chat.append(item)
        try:
            return self._template.render(
                messages=chat, tools=tools, documents=None, add_generation_prompt=True,
                **self.special_tokens, **(variables or {}),
            )  # fmt: skip
        except (jinja2.TemplateError, TypeError) as err:
            raise InvalidRequestError(f"the chat template rejected the messages: {err}") from err

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        allow_special: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt token ids of a conversation: the rendered template, encoded without adding
        special tokens (the template writes them). Message contents are plain text unless
        `allow_special` (see the module docstring); raises InvalidRequestError when that cannot
        be guaranteed."""
        rendered = self.render_chat(messages, tools, variables)
        if allow_special:
            return self._encode_with_special(rendered)
        self._refuse_special_outside(messages, tools, variables)
        marked_at = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]
        contents = [messages[i]["content"] for i in marked_at]
        sentinels = [sentinel(i) for i in marked_at]
        roles_only = (
            tools is None and not variables and len(marked_at) == len(messages)
            and all(m.keys() <= {"role", "content"} for m in messages)
        )  # fmt: skip
        if self._marked_by_roles is not None and roles_only:
            marked = self._marked_by_roles(tuple(m["role"] for m in messages))
        else:
            marks = dict(zip(marked_at, sentinels, strict=True))
            marked = self.render_chat(
                [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)],
                tools, variables,
            )  # fmt: skip
        pieces = split_at(marked, sentinels)
        if pieces is None or join(pieces, contents) != rendered:
            # The template changed the content it inserted: encode the whole text, but never
            # with a client's special-token text in it.
            if any(t in c for c in contents for t in self._special_texts):
                raise InvalidRequestError(
                    "a message contains the text of a special token, which this model's chat "
                    "template keeps kvrail from encoding as plain text",
                    "messages",
                )
            return self._encode_with_special(rendered)
        spans, start = [], 0
        for piece, content in zip(pieces, contents, strict=False):
            start += len(piece)
            spans.append((start, start + len(content)))
            start += len(content)
        return self._encode_outside(rendered, spans)

    def _refuse_special_outside(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        variables: Mapping[str, Any] | None,
    ) -> None:
        """Raise InvalidRequestError if what the template renders outside the message contents
        holds a special token's text (see the module docstring)."""
        if self._special_pattern is None:
            return
        fields = [{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages]
        outside_contents = {
            "messages": fields if any(fields) else None,  # a plain chat has none to check
            "tools": tools,
            "chat_template_kwargs": dict(variables) if variables else None,
        }
        for param, value in outside_contents.items():
            if value and self._special_pattern.search(json.dumps(value, ensure_ascii=False)):
                raise InvalidRequestError(
                    f"{param} holds the text of a special token where the chat template renders "
                    "it as the template's own text", param,
                )  # fmt: skip

    def _render_marked(self, roles: tuple[str, ...]) -> str:
        """The template rendered over `roles`, message i's content being `sentinel(i)`."""
        return self.render_chat(
            [{"role": role, "content": sentinel(i)} for i, role in enumerate(roles)]
        )

    def _encode_with_special(self, text: str) -> list[int]:
        return list(self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids)

    def _encode_outside(self, text: str, spans: Sequence[tuple[int, int]]) -> list[int]:
        """`text` encoded as the tokenizer would (split at special tokens, each part encoded
        apart), except that a special token's text inside one of `spans` is plain text."""
        cuts: list[tuple[int, int, int]] = []  # (start, end, token id) of the specials kept
        if self._special_pattern is not None:
            for match in self._special_pattern.finditer(text):
                begin, end = match.span()
                if outside(begin, end, spans):
                    cuts.append((begin, end, self._special_ids[match.group()]))
        parts: list[tuple[int, int]] = []  # (start, end) of the text between the specials kept
        position = 0
        for begin, end, _ in cuts:
            parts.append((position, begin))
            position = end
        parts.append((position, len(text)))
        # A part outside every span is the template's own text: its ids are kept, since each
        # call of the tokenizer costs several microseconds however short its text.
        fixed = [outside(begin, end, spans) for begin, end in parts]
        known: list[Sequence[int] | None] = [
            self._fixed_parts.get(text[begin:end]) if is_fixed else None
            for (begin, end), is_fixed in zip(parts, fixed, strict=True)
        ]
        missing = [text[b:e] for (b, e), found in zip(parts, known, strict=True) if found is None]
        fresh = iter(
            self._plain.encode_batch_fast(missing, add_special_tokens=False) if missing else ()
        )
        ids: list[int] = []
        for i, ((begin, end), found) in enumerate(zip(parts, known, strict=True)):
            if found is None:
                found = next(fresh).ids
                if fixed[i]:
                    self._fixed_parts.keep(text[begin:end], found)
            ids.extend(found)
            if i < len(cuts):
                ids.append(cuts[i][2])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (EOS, template markers) are left out by default."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """The text of one token decoded alone, special tokens included (how logprobs name a
        token); kept per id after its first decode. "" for an id outside the vocabulary."""
        text = self._token_texts.get(token_id)
        if text is None:
            if not 0 <= token_id < self.vocab_size:
                return ""
            text = self._token_texts[token_id] = self.decode([token_id], False)
        return text

    def special_ids(self, texts: Sequence[str]) -> dict[str, int]:
        """Those of `texts` that are special tokens of this tokenizer, with their ids."""
        return {t: self._special_ids[t] for t in texts if t in self._special_ids}

    def detokenizer(
        self,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        keep_special: frozenset[int] = frozenset(),
    ) -> Detokenizer:
        """A fresh incremental detokenizer for one request's output; the special tokens in
        `keep_special` (markers a parser reads, such as `[TOOL_CALLS]`) are kept in its text,
        the others left out."""
        if not keep_special:
            return Detokenizer(self.decode, prompt_ids, stop, min_tokens)
        drop = frozenset(self._special_ids.values()) - keep_special

        def decode(ids: list[int]) -> str:
            kept = [i for i in ids if i not in drop]
            return str(self.tokenizer.decode(kept, skip_special_tokens=False))

        return Detokenizer(decode, prompt_ids, stop, min_tokens)
