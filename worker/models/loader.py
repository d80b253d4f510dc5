"""Load a model source into a transformers config, a state dict and a tokenizer.

A GGUF source is dequantized once by transformers (about 35 s for SmolLM2 Q4_1) and cached as
safetensors under `kvrail.model_files.cache_dir()/<name>-<weights id prefix>/`, tokenizer included.
The cache entry is written into a temporary directory and renamed into place, so a reader sees
either nothing or a complete entry, never a half-written one; concurrent writers are harmless
(the loser discards its copy). A safetensors directory source is read in place. Nothing is ever
downloaded: the hub is switched off for every call here.

A tensor-parallel rank loads lazily (`load(..., lazy=True)`): the state dict then maps each name
to a safetensors slice, so the rank reads only its shard of each weight from the file, never the
whole model (what a 70B model on 8 GPUs needs: each rank's process holds 1/8 of it).

CLI: `python -P -m kvrail.worker.models.loader [SOURCE]` prepares SOURCE and prints the path.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvrail.errors import ModelNotFoundError
from kvrail.model_files import (
    DEFAULT_MODEL,
    PREPARED_MARKER,
    ModelSource,
    building,
    cache_dir,
    cache_entry_name,
    resolve,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """What a worker needs to build its model: the config, weights by transformers name (on CPU,
    in the stored dtype; or lazy slices, see `load`) and the tokenizer (None when not loaded).
    `weights_id` identifies the source weights."""

    config: Any
    state_dict: Mapping[str, Any]
    tokenizer: Any
    weights_id: str
    path: Path


def prepared_dir(source: ModelSource) -> Path:
    """Where `prepare` caches a GGUF source (side-effect free apart from hashing the file)."""
    return cache_dir() / cache_entry_name(source)


def prepare(source: ModelSource) -> Path:
    """Return a directory with config.json, safetensors weights and tokenizer files for `source`.

    Idempotent: a complete cache entry is reused as is. Raises ModelNotFoundError when the source
    cannot be converted.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not source.is_gguf:
        return source.path
    target = prepared_dir(source)
    if (target / PREPARED_MARKER).is_file():
        return target
    started = time.monotonic()
    with building(target, PREPARED_MARKER, source) as tmp:
        _convert_gguf(source, tmp)
    logger.info(
        "model prepared name=%s path=%s seconds=%.1f",
        source.name,
        target,
        time.monotonic() - started,
    )
    return target


def _convert_gguf(source: ModelSource, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(source.path.parent), source.path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(f"cannot convert GGUF file {source.path}: {err}") from err
    from safetensors.torch import save_file

    # The converted weights are plain float32 tensors: drop the GGUF quantization marker so a
    # reload from the cache does not dequantize again (transformers refuses to save a model it
    # considers quantized, hence the state dict and config are written separately).
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load(
    source: ModelSource | str = DEFAULT_MODEL, *, lazy: bool = False, tokenizer: bool = True
) -> LoadedModel:
    """Prepare `source` if needed and load its config, state dict and tokenizer (all on CPU).
    `lazy`: the state dict holds safetensors slices (`LazyWeights`), read when sliced.
    `tokenizer=False` skips the tokenizer (a rank other than 0 never needs one)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    if isinstance(source, str):
        source = resolve(source)
    path = prepare(source)
    config = AutoConfig.from_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no safetensors weights in {path}")
    state_dict: Mapping[str, Any]
    if lazy:
        state_dict = LazyWeights(files)
    else:
        loaded: dict[str, torch.Tensor] = {}
        for f in files:
            loaded.update(load_file(f))
        state_dict = loaded
    tok = AutoTokenizer.from_pretrained(path) if tokenizer else None
    logger.info("model loaded name=%s tensors=%d lazy=%s", source.name, len(state_dict), lazy)
    return LoadedModel(config, state_dict, tok, source.weights_id(), path)


class LazyWeights(Mapping[str, Any]):
    """Weights by name over safetensors files, as slices (`safe_open(...).get_slice`): indexing
    one (`w[a:b]`, `w[:, a:b]`) reads only those rows and columns from the file."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}  # noqa: SIM118

    def __getitem__(self, name: str) -> Any:
        return self._where[name].get_slice(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_transformers_model(source: ModelSource | str = DEFAULT_MODEL, dtype: Any = None) -> Any:
    """The transformers model for `source` from the prepared cache: the oracle in tests/benches."""
    from transformers import AutoModelForCausalLM

    if isinstance(source, str):
        source = resolve(source)
    model = AutoModelForCausalLM.from_pretrained(prepare(source), dtype=dtype or torch.float32)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    print(prepare(resolve(args[0] if args else DEFAULT_MODEL)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
