"""The chart's in-cluster NATS credentials, as a config file that nats-server includes.

nats-server reads a `$VARIABLE` in its config as a config value, not as a string. A password
from the environment that starts with a digit parses as a number, and one with a space or a
brace as something else, so the server does not start. The chart's NATS pod therefore keeps the
Secret out of the server's environment. An init container runs

    python -P -m kvrail.nats_auth SECRET_DIR OUT_FILE

which reads `username` and `password` from the mounted Secret and writes them as quoted strings
for `authorization { include ../auth/auth.conf }` in the chart's `nats.conf`. Any text works,
whether the chart generated it or `nats.auth.existingSecret` holds it. An empty or missing value,
or a control character other than tab, is refused with a message and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\t": "\\t"}


def quoted(value: str) -> str:
    """`value` as a double-quoted nats-server config string (nothing in it is expanded).
    Raises ValueError for other control characters, which such a string cannot hold."""
    if any((ord(c) < 0x20 and c != "\t") or c == "\x7f" for c in value):
        raise ValueError("contains a control character (a newline, say)")
    return '"' + "".join(_ESCAPES.get(c, c) for c in value) + '"'


def auth_conf(user: str, password: str) -> str:
    """The body of nats.conf's `authorization` block for one user."""
    return f"user: {quoted(user)}\npassword: {quoted(password)}\n"


def _read(secret_dir: Path, key: str) -> str:
    """A Secret's value as kvrail's clients take it: the password without one trailing newline
    (`kvrail.settings.read_secret`, from the file mounted for them), the username as it is (they
    get it through their environment)."""
    path = secret_dir / key
    try:
        value = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    if key == "password":
        value = value.removesuffix("\n")
    if not value:
        raise ValueError(f"{path} is empty")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P -m kvrail.nats_auth", description=__doc__)
    parser.add_argument("secret_dir", type=Path, help="the mounted Secret: username, password")
    parser.add_argument("out", type=Path, help="the file nats.conf includes")
    args = parser.parse_args(argv)
    try:
        user = _read(args.secret_dir, "username")
        password = _read(args.secret_dir, "password")
        try:
            text = auth_conf(user, password)
        except ValueError as err:
            raise ValueError(f"the NATS username or password {err}") from err
    except ValueError as err:
        print(f"kvrail.nats_auth: {err}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
