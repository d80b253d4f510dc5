from __future__ import annotations

from pathlib import Path

import pytest

from kvrail.crd.spec import PACKAGED_MODEL_NAMES
from kvrail.errors import ModelNotFoundError
from kvrail.model_files import PACKAGED_MODELS, resolve


def test_default_model_resolves_to_the_gguf_file_the_package_ships() -> None:
    src = resolve()
    assert src.is_gguf and src.path.is_file()
    assert src.served_name == "SmolLM2-135M-Instruct"
    assert src.path.stat().st_size > 50_000_000


def test_the_api_names_exactly_the_packaged_models() -> None:
    assert tuple(PACKAGED_MODELS) == PACKAGED_MODEL_NAMES


def test_weights_id_is_the_sha256_of_the_file_and_is_memoised(tmp_path: Path) -> None:
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF" + bytes(100))
    first = resolve(str(f)).weights_id()
    assert first.startswith("gguf-sha256:") and len(first) == len("gguf-sha256:") + 64
    assert resolve(str(f)).weights_id() == first


def test_a_model_directory_needs_a_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve(str(tmp_path)).path == tmp_path.resolve()


@pytest.mark.parametrize("source", ["meta-llama/Llama-3-8B", "/nonexistent/model.gguf"])
def test_unknown_sources_are_refused_without_a_download(source: str) -> None:
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve(source)
