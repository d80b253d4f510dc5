"""The `chat_template` setting's file (a ConfigMap key the operator mounts, or any path): read and
checked when the router starts, and a router whose file is unusable stops at once, naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrail.errors import ConfigError
from kvrail.router.text.chat_template import template_file

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
