"""Model loader: the converted cache is written atomically, reused, and loads the real SmolLM2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvrail.model_files import ModelSource
from kvrail.worker.models import loader


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelSource:
    monkeypatch.setenv("KVRAIL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"not really gguf")
    return ModelSource(name=str(path), served_name="tiny model", path=path)


def test_a_failed_conversion_leaves_neither_an_entry_nor_a_temporary_directory(
    fake_gguf: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_then_fail(source: ModelSource, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(loader, "_convert_gguf", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        loader.prepare(fake_gguf)
    target = loader.prepared_dir(fake_gguf)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if p.name != "sha256"] == []


def test_a_complete_entry_is_reused_without_converting_again(
    fake_gguf: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []

    def convert(source: ModelSource, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    first = loader.prepare(fake_gguf)
    second = loader.prepare(fake_gguf)
    assert first == second == loader.prepared_dir(fake_gguf)
    assert len(calls) == 1
    assert (first / "config.json").is_file() and (first / "kvrail-prepared.json").is_file()
    assert first.name.startswith("tiny_model-")


def test_a_safetensors_directory_is_used_in_place(tmp_path: Path) -> None:
    source = ModelSource(name="dir", served_name="dir", path=tmp_path)
    assert loader.prepare(source) == tmp_path


def test_smollm2_loads_as_a_llama_with_tokenizer_and_every_weight(smollm2: Any) -> None:
    assert smollm2.config.model_type == "llama"
    assert smollm2.weights_id.startswith("gguf-sha256:")
    assert "model.layers.29.mlp.down_proj.weight" in smollm2.state_dict
    assert smollm2.tokenizer.decode(smollm2.tokenizer("Hello world").input_ids) == "Hello world"
