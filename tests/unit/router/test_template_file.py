"""The `chat_template` setting's file (a ConfigMap key the operator mounts, or any path): read and
checked when the router starts, and a router whose file is unusable stops at once, naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrail.errors import ConfigError
from kvrail.router.output import detect
from kvrail.router.text.chat_template import template_file
from kvrail.router.text.tokenizer import TextCodec
from kvrail.settings import default_cache_dir

HERMES_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


def test_a_template_file_is_read_as_written(tmp_path: Path) -> None:
    path = tmp_path / "chat_template.jinja"
    path.write_text(HERMES_LIKE, encoding="utf-8")
    assert template_file(path) == HERMES_LIKE


@pytest.mark.parametrize(
    ("content", "word"),
    [
        (b"", "empty"),
        (b"  \n\t\n", "empty"),
        (b"{{ messages[0].content ", "not a Jinja template"),
        (b"{% for m in messages %}{{ m.content }}", "not a Jinja template"),
        (b"\xff\xfe{{ messages }}", "not UTF-8"),
    ],
    ids=["empty", "blank", "unclosed expression", "unclosed block", "latin-1 bytes"],
)
def test_an_unusable_template_is_a_config_error_naming_the_file(
    tmp_path: Path, content: bytes, word: str
) -> None:
    path = tmp_path / "chat_template.jinja"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=word) as err:
        template_file(path)
    assert str(path) in str(err.value)


def test_a_missing_file_or_a_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        template_file(tmp_path / "absent.jinja")
    with pytest.raises(ConfigError, match=str(tmp_path)):
        template_file(tmp_path)


@pytest.mark.parametrize("name", ["absent.jinja", "empty.jinja"])
def test_the_router_stops_at_start_naming_the_template_file(tmp_path: Path, name: str) -> None:
    """Before it loads a tokenizer or connects to anything: exit status 2 and one line."""
    (tmp_path / "empty.jinja").write_text("")
    env = {**os.environ, "KVRAIL_CHAT_TEMPLATE": str(tmp_path / name)}
    done = subprocess.run(
        [sys.executable, "-P", "-m", "kvrail.router"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"chat_template {tmp_path / name}" in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr


EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "agents" / "chatml_tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_the_agents_examples_template_renders_tools_calls_and_results_for_smollm2() -> None:
    """examples/agents-tools.yaml mounts this file in the router: with the real SmolLM2
    tokenizer it renders tools itself (no default tool prompt), in the Hermes format the
    example names, and a whole tool round trip encodes with the template's control tokens."""
    text = template_file(EXAMPLE)
    assert (detect.tool_parser("auto", text), detect.reasoning_parser("auto", text)) == (
        "hermes", False,
    )  # fmt: skip
    plain = TextCodec.load("smollm2", default_cache_dir())
    assert plain.directory is not None
    codec = TextCodec.from_directory(plain.directory, plain.served_name, text)
    assert codec.renders_tools and not plain.renders_tools
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    rendered = codec.render_chat(conversation, tools=[WEATHER])
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions:")
    assert '"name": "get_weather"' in rendered.split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in (
        rendered
    )
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.count("<|im_start|>system") == 1
    ids = codec.chat_prompt(conversation, tools=[WEATHER])
    assert ids.count(codec.encode("<|im_start|>", allow_special=True)[0]) == 5
