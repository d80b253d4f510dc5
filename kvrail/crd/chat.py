"""How the router talks to the model in chat: its chat template, and the parsers that read tool
calls and reasoning out of its answers (`spec.model.chatTemplate`, `toolCallParser`,
`reasoningParser`). The router applies all three for every engine: with engine kind `vllm` too
it renders the template and parses the answer itself, and sends vLLM token ids only
(`kvrail.vllm.protocol`), so they mean the same on both engines and vLLM gets no flag for them.

The template is referenced, never inlined in the pool. Chat templates run from a few hundred
bytes to tens of kilobytes (Qwen3's is about 4 KB, tool-using Mistral and Llama 3.1 ones 5 to
15 KB), and an inline string would need a `maxLength` generous enough for the longest, which
every CEL rule over the spec pays for in its cost estimate, and YAML escaping of Jinja. A
ConfigMap key holds up to 1 MiB, is written with `kubectl create configmap <name>
--from-file=chat_template.jinja` straight from the model's own file, can serve several pools,
and reaches the router as a mounted file, which is what the router's `chat_template` setting
reads.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import ConfigDict, Field

from kvrail.crd.base import CrdModel, rule, rules

ToolCallParser = Literal["auto", "hermes", "llama3_json", "mistral"]
"""The router's tool-call formats (`kvrail.settings.Settings.tool_call_parser`; a test keeps the
two in step)."""
ReasoningParser = Literal["auto", "think", "none"]
"""The router's reasoning parsers (`kvrail.settings.Settings.reasoning_parser`)."""
CHAT_TEMPLATE_KEY: Final = "chat_template.jinja"
"""The key a template is looked up under by default: the file name transformers writes."""
DNS_SUBDOMAIN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class ConfigMapKeyRef(CrdModel):
    """One key of a ConfigMap in the pool's namespace."""

    model_config = ConfigDict(
        json_schema_extra=rules(
            rule(
                "!has(self.key) || (self.key != '.' && !self.key.startsWith('..'))",
                "configMapKeyRef.key must be a ConfigMap key: letters, digits, '-', '_' and '.', "
                "and neither '.' nor starting with '..'",
                ".key",
            ),
        )
    )
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    """The ConfigMap's name. It must exist before the router can start (its pods wait for it)."""
    key: str = Field(CHAT_TEMPLATE_KEY, min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    """The key holding the template. Default `chat_template.jinja`."""


class ChatTemplateSpec(CrdModel):
    """A Jinja chat template used instead of the model's own."""

    config_map_key_ref: ConfigMapKeyRef
    """The ConfigMap key holding the template (UTF-8 text, at most 1 MiB as any ConfigMap).
    Mounted read-only in the router, which reads it when it starts: after editing the ConfigMap,
    restart the router (`kubectl rollout restart deployment/<pool>-router`)."""
