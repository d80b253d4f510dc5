"""STYLE.md §3: every subpackage ships in the wheel, and the wheel imports outside the repo."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = {
    "kvrail": "kvrail",
    "operator": "kvrail.operator",
    "worker": "kvrail.worker",
    "router": "kvrail.router",
    "kernels": "kvrail.kernels",
    "agent": "kvrail.agent",
    "cli": "kvrail.cli",
    "local": "kvrail.local",
    "testing": "kvrail.testing",
    "epp": "kvrail.epp",
}


def _declared() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["setuptools"]["packages"])


def _on_disk() -> set[str]:
    found = set()
    for folder, package in COMPONENTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    return found


def test_declared_packages_are_exactly_the_package_folders() -> None:
    assert sorted(_declared()) == sorted(_on_disk())


def _folder(package: str) -> Path:
    """The source folder of a package, following pyproject's package-dir mapping."""
    for folder, mapped in sorted(COMPONENTS.items(), key=lambda kv: -len(kv[1])):
        if package == mapped or package.startswith(mapped + "."):
            rest = package[len(mapped) :].lstrip(".")
            return ROOT / folder / rest.replace(".", "/")
    raise AssertionError(f"{package} is outside kvrail")


def test_every_package_ships_py_typed() -> None:
    for package in _declared():
        assert (_folder(package) / "py.typed").is_file(), package


@pytest.mark.slow
def test_the_wheel_contains_and_imports_every_package(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-P", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("kvrail-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path / "site")
    for package in _declared():
        path = package.replace(".", "/")
        assert f"{path}/__init__.py" in names, f"{package} missing from the wheel"
        assert f"{path}/py.typed" in names, f"{package} has no py.typed in the wheel"
    # Import from the unpacked wheel, outside the repository, with the repo off sys.path.
    code = (
        "import importlib, sys\n"
        f"for name in {_declared()!r}:\n"
        "    m = importlib.import_module(name)\n"
        f"    assert m.__file__.startswith({str(tmp_path / 'site')!r}), (name, m.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    subprocess.run([sys.executable, "-P", "-c", code], check=True, cwd=tmp_path, env=env,
                   timeout=120)  # fmt: skip


def test_the_layer_contract_lists_every_module_of_the_contract_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"].startswith("the contract package")]
    on_disk = {f"kvrail.{p.stem}" for p in (ROOT / "kvrail").glob("*.py") if p.stem != "__init__"}
    on_disk |= {
        f"kvrail.{p.name}" for p in (ROOT / "kvrail").iterdir() if (p / "__init__.py").exists()
    }
    assert sorted(contract["source_modules"]) == sorted(on_disk)


def test_package_dir_maps_every_top_level_package_folder() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    assert mapping == {package: folder for folder, package in COMPONENTS.items()}


# The components whose modules must each sit in a layer of their component's `layers` contract.
# A component gets into this list with its contract (the operator and the agent have none yet).
LAYERED_COMPONENTS = ("worker", "router", "epp")


def _component_layers(package: str) -> list[str]:
    """The modules named by the `layers` contract of a component's own children (not a nested
    contract such as the router's streams, whose modules sit one level further down)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = []
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] != "layers":
            continue
        names = [m.strip() for layer in contract["layers"] for m in layer.split("|")]
        if all(m.rpartition(".")[0] == package for m in names):
            found.append(names)
    assert len(found) == 1, f"{package} has {len(found)} layers contracts of its own modules"
    return found[0]


def _component_modules(folder: str, package: str) -> set[str]:
    """Every module and subpackage of a component, by walking its folder."""
    modules = set()
    for path in (ROOT / folder).rglob("*.py"):
        parts = path.relative_to(ROOT / folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            modules.add(".".join([package, *parts]))
    return modules


@pytest.mark.parametrize("folder", LAYERED_COMPONENTS)
def test_every_module_of_a_component_sits_in_a_layer_of_its_contract(folder: str) -> None:
    """A module outside every layer escapes the contract: nothing checks what it imports or
    what imports it. A module inside a listed subpackage is covered by it."""
    package = COMPONENTS[folder]
    listed = _component_layers(package)
    outside = sorted(
        module
        for module in _component_modules(folder, package)
        if not any(module == m or module.startswith(m + ".") for m in listed)
    )
    assert outside == [], f"in no layer of {package}'s layers contract (pyproject.toml)"
