"""The router's text layer: tokenizer, chat template, incremental detokenization with stop strings.

Everything here runs on `tokenizers` and `jinja2` only; the router process never imports torch
(an import-linter contract). Tokenizer files come from, in order:
1. a model directory that has `tokenizer.json` (read in place);
2. the worker's converted cache, `<cache_dir>/models/<name>-<weights id prefix>/` (the naming
   rule and the atomic build are shared with the worker's loader in `kvrail.models`), when a
   worker on this machine prepared it;
3. the router's own cache, `<cache_dir>/tokenizers/<name>-<weights id prefix>/`, written once by
   a subprocess that runs transformers (which imports torch) on the GGUF file or directory and
   saves its tokenizer. The entry is written into a temporary directory and renamed into place,
   so a reader sees nothing or a complete entry.

The chat template is rendered as transformers renders it (sandboxed Jinja, `trim_blocks`,
`lstrip_blocks`, the same globals), so `chat_prompt` equals transformers'
`apply_chat_template(..., tokenize=True, add_generation_prompt=True)`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvrail.errors import InvalidRequestError, ModelNotFoundError
from kvrail.models import (
    PREPARED_MARKER,
    ModelSource,
    building,
    cache_entry_name,
    resolve,
)
from kvrail.models import cache_dir as models_cache_dir

log = logging.getLogger(__name__)

TOKENIZER_MARKER = "kvrail-tokenizer.json"  # written last by ours
CONVERT_TIMEOUT_S = 600.0
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_CONVERT = """
import sys
from pathlib import Path
from transformers import AutoTokenizer
src, out = Path(sys.argv[1]), Path(sys.argv[2])
if src.suffix == ".gguf":
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
else:
    tok = AutoTokenizer.from_pretrained(str(src))
tok.save_pretrained(str(out))
if not (out / "tokenizer.json").is_file():
    sys.exit("this tokenizer has no tokenizers (fast) form")
"""


class TextCodec:
    """A model's tokenizer and chat template. Immutable after construction and safe to share
    between concurrent requests (the `tokenizers` Tokenizer is thread-safe for encode/decode)."""

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
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def load(cls, model: str, cache_dir: Path) -> TextCodec:
        """Resolve `model` (see `kvrail.models.resolve`) and load its tokenizer, converting a GGUF
        file once into the cache when no worker did. Raises ModelNotFoundError."""
        started = time.monotonic()
        source = resolve(model)
        directory = tokenizer_dir(source, cache_dir)
        codec = cls.from_directory(directory, source.served_name)
        log.info(
            "tokenizer loaded name=%s path=%s vocab=%d seconds=%.2f",
            source.served_name,
            directory,
            codec.vocab_size,
            time.monotonic() - started,
        )
        return codec

    @classmethod
    def from_directory(cls, directory: Path, served_name: str) -> TextCodec:
        """Load `tokenizer.json`, `tokenizer_config.json` and the chat template from a directory
        laid out by transformers' `save_pretrained`."""
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelNotFoundError(f"no tokenizer.json in {directory}")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / "special_tokens_map.json")
        config.update(_read_json(directory / "tokenizer_config.json"))
        special = {k: t for k in _SPECIAL_TOKENS if (t := _token_content(config.get(k)))}
        template = _chat_template(directory, config)
        eos: list[int] = []
        if (
            "eos_token" in special
            and (tid := tokenizer.token_to_id(special["eos_token"])) is not None
        ):
            eos.append(tid)
        for name in ("generation_config.json", "config.json"):
            value = _read_json(directory / name).get("eos_token_id")
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

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer's own post-processor adds
        (none for SmolLM2), as transformers' `tokenizer(text)` gives them."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The chat template applied to `messages` with `add_generation_prompt=True`. A template
        that does not know the `developer` role sees it as `system`. Raises InvalidRequestError
        when the model has no template or the template rejects the conversation."""
        if self._template is None:
            raise InvalidRequestError(f"model {self.served_name} has no chat template")
        knows_developer = "developer" in (self.chat_template or "")
        chat = []
        for m in messages:
            item = {k: v for k, v in m.items() if v is not None}
            if item.get("role") == "developer" and not knows_developer:
                item["role"] = "system"
            chat.append(item)
        try:
            return self._template.render(
                messages=chat, tools=None, documents=None, add_generation_prompt=True,
                **self.special_tokens,
            )  # fmt: skip
        except jinja2.TemplateError as err:
            raise InvalidRequestError(f"the chat template rejected the messages: {err}") from err

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The prompt token ids of a conversation: the rendered template, encoded without adding
        special tokens (the template writes them)."""
        return list(self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (EOS, template markers) are left out by default."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> Detokenizer:
        """A fresh incremental detokenizer for one request's output."""
        return Detokenizer(self.decode, prompt_ids, stop)


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
    at the start of a text would otherwise lose it), unless it ends mid-character.
    """

    CONTEXT_TOKENS = 5

    def __init__(
        self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int], stop: Sequence[str]
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
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
        return self._emit(self._decode_new(final=False), final=False)

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
        if self._matcher is None:
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


# ---------------------------------------------------------------------------------------------
# Finding and converting tokenizer files


def tokenizer_dir(source: ModelSource, cache_dir: Path) -> Path:
    """A directory with `tokenizer.json` for `source`, converting it once if needed."""
    if not source.is_gguf and (source.path / "tokenizer.json").is_file():
        return source.path
    entry = cache_entry_name(source)
    prepared = models_cache_dir(cache_dir) / entry
    if (prepared / PREPARED_MARKER).is_file() and (prepared / "tokenizer.json").is_file():
        return prepared
    own = cache_dir / "tokenizers" / entry
    if not (own / TOKENIZER_MARKER).is_file():
        _convert(source, own)
    return own


def _convert(source: ModelSource, target: Path) -> None:
    """Run transformers in a subprocess (it imports torch) to save the tokenizer of `source`
    into `target`, atomically. Raises ModelNotFoundError."""
    started = time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with building(target, TOKENIZER_MARKER, source) as tmp:
        try:
            done = subprocess.run(
                [sys.executable, "-P", "-c", _CONVERT, str(source.path), str(tmp)],
                env=env, cwd=tmp, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S,
                check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as err:
            raise ModelNotFoundError(
                f"converting the tokenizer of {source.path} took over {CONVERT_TIMEOUT_S:.0f} s"
            ) from err
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
            raise ModelNotFoundError(f"cannot convert the tokenizer of {source.path}: {lines[-1]}")
    log.info(
        "tokenizer converted name=%s path=%s seconds=%.1f",
        source.name,
        target,
        time.monotonic() - started,
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (transformers >= 4.50 writes it), else tokenizer_config.json's
    `chat_template`: a string, or a list of named templates of which `default` is used."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


# ---------------------------------------------------------------------------------------------
# The Jinja environment, as transformers builds it for chat templates


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes (no reaching into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _Dict:
    """`dict()` for templates without exposing the type itself (no attribute tricks on it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ModelNotFoundError(f"the model's chat template does not compile: {err}") from err
