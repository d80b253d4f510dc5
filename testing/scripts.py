"""Load a benchmark script as a module: `bench/` is not a package, and `python -P` (which every
script and test runs with) puts no script folder on the import path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(name: str, path: Path) -> ModuleType:
    """The module in `path`, registered as `name` (dataclasses look their module up in
    `sys.modules` while a class is built)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
