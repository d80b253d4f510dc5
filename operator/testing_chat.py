"""CEL cases of the model's chat fields (`spec.model.chatTemplate`, `toolCallParser`,
`reasoningParser`), in the shape of `kvrail.operator.testing`'s `REFUSED` and `ACCEPTED` tables:
for the cel-python unit tests and the real API server tests.

Every name and key here matches the schema's pattern and every parser its enum, so what refuses
a case is a CEL rule (pattern and enum violations are the schema's, tested apart).
"""

from __future__ import annotations

from typing import Any

from kvrail.operator.testing import COLOCATED, VLLM, Change


def template(name: str = "agents-template", key: str | None = None) -> Change:
    """`spec.model.chatTemplate` naming one ConfigMap key (the default key when None)."""
    ref: dict[str, Any] = {"name": name} if key is None else {"name": name, "key": key}
    return ("spec.model.chatTemplate", {"configMapKeyRef": ref})


HERMES_THINK: tuple[Change, ...] = (
    ("spec.model.toolCallParser", "hermes"),
    ("spec.model.reasoningParser", "think"),
)

CHAT_REFUSED: list[tuple[str, tuple[Change, ...], str, str]] = [
    (
        "a chat template in the ConfigMap the operator deletes",
        (template("tiny-config"),),
        ".spec.model.chatTemplate.configMapKeyRef.name",
        "<pool>-config",
    ),
    (
        "a chat template key of one dot",
        (template(key="."),),
        ".spec.model.chatTemplate.configMapKeyRef.key",
        "ConfigMap key",
    ),
    (
        "a chat template key of two dots",
        (template(key=".."),),
        ".spec.model.chatTemplate.configMapKeyRef.key",
        "ConfigMap key",
    ),
    (
        "a chat template key starting with two dots",
        (template(key="..data"),),
        ".spec.model.chatTemplate.configMapKeyRef.key",
        "ConfigMap key",
    ),
]

CHAT_ACCEPTED: list[tuple[str, tuple[Change, ...]]] = [
    ("a chat template under the default key", (template(),)),
    ("a chat template under its own key", (template(key="qwen3.chat_template.jinja"),)),
    ("a hidden key with one leading dot", (template(key=".template"),)),
    ("a ConfigMap named like the pool's, but not <pool>-config", (template("tiny-config-v2"),)),
    ("parsers without a template", HERMES_THINK),
    ("every other parser", (("spec.model.toolCallParser", "mistral"),
                            ("spec.model.reasoningParser", "none"))),
    ("llama3_json", (("spec.model.toolCallParser", "llama3_json"),)),
    ("a vllm pool with a template and both parsers", (*VLLM, template(), *HERMES_THINK)),
    ("a colocated vllm pool with a template", (*VLLM, *COLOCATED, template())),
]  # fmt: skip

CHAT_SCHEMA_REFUSED: list[tuple[str, Change, str]] = [
    ("a tool-call parser kvrail has not", ("spec.model.toolCallParser", "pythonic"),
     "spec.model.toolCallParser"),
    ("a reasoning parser named as vLLM names it", ("spec.model.reasoningParser", "deepseek_r1"),
     "spec.model.reasoningParser"),
    ("a chat template that references nothing", ("spec.model.chatTemplate", {}),
     "spec.model.chatTemplate.configMapKeyRef"),
    ("a ConfigMap name with upper case", template("Qwen3_Template"),
     "spec.model.chatTemplate.configMapKeyRef.name"),
    ("a ConfigMap key with a slash", template(key="templates/qwen3.jinja"),
     "spec.model.chatTemplate.configMapKeyRef.key"),
    ("an inline template", ("spec.model.chatTemplate", {"inline": "{{ messages }}"}),
     "spec.model.chatTemplate"),
]  # fmt: skip
"""Manifests the schema (enum, pattern, required, unknown field) refuses, as (case, change,
the field named): for the model tests and the real API server."""
