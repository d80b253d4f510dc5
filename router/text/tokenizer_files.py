"""Where the router's tokenizer files come from (`tokenizer_dir`): a model directory, the
worker's converted cache, or the router's own cache, converted once from a GGUF file by a
subprocess that runs transformers (which imports torch, which the router process never does).
The entry is written into a temporary directory and renamed into place, so a reader sees
nothing or a complete entry."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvrail.errors import ModelNotFoundError
from kvrail.model_files import PREPARED_MARKER, ModelSource, building, cache_entry_name
from kvrail.model_files import cache_dir as models_cache_dir

log = logging.getLogger(__name__)

TOKENIZER_MARKER = "kvrail-tokenizer.json"  # written last by ours
CONVERT_TIMEOUT_S = 600.0
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


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None
