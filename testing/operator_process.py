"""Run the operator against a real cluster the way it runs in production: under the Helm chart's
RBAC, with its own ServiceAccount token. Used by `tests/e2e/` and `bench/operator/`.

Nothing here is imported by the operator itself. Tokens go into a kubeconfig file (mode 0600) and
never into a log line or an exception message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kvrail.local.procs import ManagedProcess, free_port, http_ok

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kvrail"
OPERATOR_NAMESPACE = "kvrail-system"
RELEASE = "kvrail"
OPERATOR_SERVICE_ACCOUNT = f"{RELEASE}-operator"
RBAC_TEMPLATES = (
    "templates/operator/serviceaccount.yaml",
    "templates/rbac/clusterrole.yaml",
    "templates/rbac/role.yaml",
)
T = TypeVar("T")


def render_chart(
    helm: Path,
    values: Sequence[str] = (),
    show_only: Sequence[str] = (),
    kube_version: str = "1.36",
) -> str:
    """`helm template` of the chart as release `kvrail` in `kvrail-system`; `values` are --set."""
    argv = [str(helm), "template", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
            "--kube-version", kube_version]  # fmt: skip
    for value in values:
        argv += ["--set", value]
    for template in show_only:
        argv += ["--show-only", template]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"helm template failed: {done.stderr.strip()}")
    return done.stdout


def operator_rbac(helm: Path, namespaces: Sequence[str]) -> list[dict[str, Any]]:
    """The chart's ServiceAccount, ClusterRole(s) and Role(s) for an operator watching
    `namespaces`, as manifests."""
    values = ["etcd.enabled=false", "nats.enabled=false",
              f"operator.watchNamespaces={{{','.join(namespaces)}}}"]  # fmt: skip
    text = render_chart(helm, values, RBAC_TEMPLATES)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def token_kubeconfig(admin_kubeconfig: Path, token: str, path: Path) -> Path:
    """A copy of the admin kubeconfig (same server and CA) that authenticates with `token`."""
    config = yaml.safe_load(admin_kubeconfig.read_text())
    config["users"] = [{"name": "operator", "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = "operator"
    path.touch(mode=0o600)
    path.write_text(yaml.safe_dump(config))
    return path


def start_operator(
    kubeconfig: Path,
    namespaces: Sequence[str],
    log_path: Path,
    timeout_s: float = 60,
    settings: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """`kopf run --standalone -m kvrail.operator.main --namespace ...`, outside the repo root
    (STYLE.md §3), ready once Kopf's liveness endpoint answers. `settings` become `KVRAIL_*`
    variables (e.g. `{"etcd_endpoints": ..., "nats_url": ...}` for the harness's servers)."""
    port = free_port()
    kopf = Path(sys.executable).parent / "kopf"
    argv = [str(kopf), "run", "--standalone", "--log-format=full", "-m", "kvrail.operator.main",
            f"--liveness=http://127.0.0.1:{port}/healthz"]  # fmt: skip
    argv += [f"--namespace={n}" for n in namespaces]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "KVRAIL_"))}
    env["KUBECONFIG"] = str(kubeconfig)
    env.update({f"KVRAIL_{k.upper()}": v for k, v in (settings or {}).items()})
    proc = ManagedProcess("kvrail-operator", argv, log_path, env=env, cwd=log_path.parent)
    proc.start()
    try:
        proc.wait_ready(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), timeout_s, 0.2)
    except BaseException:
        proc.stop()
        raise
    return proc


def launch_operator(
    admin_kubeconfig: Path,
    helm: Path,
    namespaces: Sequence[str],
    workdir: Path,
    settings: Mapping[str, str] | None = None,
    timeout_s: float = 60,
) -> tuple[ManagedProcess, Path, str]:
    """The whole production-like start, as the admin: the namespaces and the chart's RBAC
    applied (idempotently), a token for the operator's ServiceAccount, and the operator started
    with only that token. Returns (process, its kubeconfig, the token: for leak checks only)."""
    kubectl = [str(Path(sys.executable).parent / "kubectl"), f"--kubeconfig={admin_kubeconfig}"]
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}
        for n in (OPERATOR_NAMESPACE, *namespaces)
    ]
    _kubectl([*kubectl, "apply", "-f", "-"], yaml.safe_dump_all(docs))
    _kubectl([*kubectl, "apply", "-f", "-"], yaml.safe_dump_all(operator_rbac(helm, namespaces)))
    token = _kubectl([*kubectl, "-n", OPERATOR_NAMESPACE, "create", "token",
                      OPERATOR_SERVICE_ACCOUNT, "--duration=1h"]).strip()  # fmt: skip
    kubeconfig = token_kubeconfig(admin_kubeconfig, token, workdir / "operator.kubeconfig")
    operator = start_operator(kubeconfig, namespaces, workdir / "operator.log", timeout_s, settings)
    return operator, kubeconfig, token


def _kubectl(argv: list[str], stdin: str | None = None) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
    if done.returncode != 0:  # stderr only: stdout may hold a token
        raise RuntimeError(f"kubectl {argv[2]} failed: {done.stderr.strip()}")
    return done.stdout


def wait_for(
    what: str, check: Callable[[], T | None], timeout_s: float, interval_s: float = 0.2
) -> T:
    """Poll `check` until it returns a truthy value, which is returned; fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f}s (last: {value!r})")
        time.sleep(interval_s)
