"""The chat template: read from a model's tokenizer files and compiled as transformers compiles
it (sandboxed Jinja, `trim_blocks`, `lstrip_blocks`, the same globals and filters), so rendering
it gives what transformers' `apply_chat_template` gives.

Runs on `jinja2` only; the router process never imports torch (an import-linter contract).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvrail.errors import ConfigError, ModelNotFoundError


def chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
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


def template_file(path: Path) -> str:
    """The `chat_template` setting's file (e.g. a ConfigMap key the operator mounted), checked
    when the router starts: ConfigError naming the file when it cannot be read, is not UTF-8,
    holds nothing (which would otherwise fall back to the model's template unnoticed) or does
    not compile."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"chat_template {path}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"chat_template {path}: not UTF-8 text (byte {err.start})") from err
    if not text.strip():
        raise ConfigError(f"chat_template {path}: the file is empty")
    try:
        _environment().parse(text)
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(
            f"chat_template {path}: not a Jinja template: {err.message} (line {err.lineno})"
        ) from err
    return text


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


def compile_template(template: str) -> jinja2.Template:
    """`template` compiled as transformers compiles chat templates. Raises ModelNotFoundError
    when it does not compile."""
    env = _environment()
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ModelNotFoundError(f"the model's chat template does not compile: {err}") from err


def template_variables(template: str) -> frozenset[str]:
    """The names `template` reads from its render arguments (`messages`, `tools`,
    `enable_thinking`, ...), as vLLM finds which `chat_template_kwargs` a template takes.
    Raises ModelNotFoundError when it does not compile."""
    env = _environment()
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateSyntaxError as err:
        raise ModelNotFoundError(f"the model's chat template does not compile: {err}") from err


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env
