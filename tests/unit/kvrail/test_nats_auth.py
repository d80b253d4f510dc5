"""kvrail.nats_auth: the chart's NATS credentials as quoted strings in an included file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrail.nats_auth import auth_conf, main, quoted


def test_quotes_and_backslashes_are_escaped_and_nothing_else_changes() -> None:
    assert quoted("plain") == '"plain"'
    assert quoted('a"b\\c') == '"a\\"b\\\\c"'
    assert quoted("tab\there $VAR {x} ünï") == '"tab\\there $VAR {x} ünï"'
    assert auth_conf("u", "1") == 'user: "u"\npassword: "1"\n'


@pytest.mark.parametrize("value", ["new\nline", "cr\r", "nul\x00", "del\x7f"])
def test_a_control_character_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="control character"):
        quoted(value)


def test_main_writes_the_file_only_its_user_reads(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "username").write_text("kvrail")
    (secret / "password").write_text('1"x\n')  # one newline stripped, as the clients do
    out = tmp_path / "auth" / "auth.conf"
    assert main([str(secret), str(out)]) == 0
    assert out.read_text() == auth_conf("kvrail", '1"x')
    assert out.stat().st_mode & 0o777 == 0o400


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"username": "kvrail"}, "cannot read"),
        ({"username": "kvrail", "password": ""}, "is empty"),
        ({"username": "kvrail", "password": "two\nlines"}, "control character"),
    ],
)
def test_main_refuses_a_missing_empty_or_unquotable_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], files: dict[str, str], message: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "auth.conf"
    assert main([str(tmp_path), str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
