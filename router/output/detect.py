"""Which parsers a model needs, read from its chat template when the settings say `auto`
(`tool_call_parser`, `reasoning_parser`).

- tool calls: a template that writes `[TOOL_CALLS]` is Mistral's, one that writes `<tool_call>`
  Hermes' (Qwen's), one that writes Llama's `<|python_tag|>` Llama 3's JSON; any other
  template (one that ignores tools included, which gets kvrail's default tool prompt in the
  Hermes format) is read as Hermes;
- reasoning: a template that writes both `<think>` and `</think>` (Qwen3, DeepSeek-R1) thinks
  between them; any other has no reasoning parser.
"""

from __future__ import annotations

from typing import Literal

from kvrail.router.output.reasoning import END, START
from kvrail.router.output.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParserName,
)

ToolParserSetting = Literal["auto", "hermes", "llama3_json", "mistral"]
ReasoningSetting = Literal["auto", "think", "none"]


def tool_parser(setting: ToolParserSetting, template: str | None) -> ParserName:
    if setting != "auto":
        return setting
    text = template or ""
    if MistralParser.MARKER in text:
        return "mistral"
    if HermesParser.OPEN in text:
        return "hermes"
    if Llama3JsonParser.TAG in text:
        return "llama3_json"
    return "hermes"


def reasoning_parser(setting: ReasoningSetting, template: str | None) -> bool:
    if setting != "auto":
        return setting == "think"
    text = template or ""
    return START in text and END in text
