"""Session-scoped real servers: etcd, NATS with JetStream, a Kubernetes control plane, and a
real node with a Gateway (`real_cluster`).

Each server binds to a free loopback port, keeps its data and log under pytest's temporary
directory (kept after the run; the path is printed when a test failed) and is stopped at the end
of the session. Under CI=true a missing binary fails the test instead of skipping it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.kube import (
    APISERVER_BINARIES,
    CLUSTER_BINARIES,
    KubeControlPlane,
    default_bin_dir,
    missing_binaries,
)
from kvrail.testing.node import NODE_BINARIES, NODE_TOOLS
from kvrail.testing.real_cluster import RealCluster
from kvrail.testing.real_cluster import real_cluster as real_cluster_of

IN_CI = os.environ.get("CI") == "true"


def pytest_configure(config: pytest.Config) -> None:
    """Without CUDA, Triton runs interpreted. It chooses at each `@triton.jit` definition,
    its own library's (`tl.sum`...) included, so the choice is made before a test imports
    triton, which transformers may do through torch; `kvrail.kernels.testing` refuses a
    process where it was not."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_LOG_DIRS: list[Path] = []


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: missing prerequisites fail, they do not skip)")
    pytest.skip(reason)


def k8s_bin_dir() -> Path:
    cache = os.environ.get("K8S_HARNESS_CACHE") or str(Path.home() / ".cache/kvrail/k8s")
    return default_bin_dir(Path(cache))


def _require_binaries(names: tuple[str, ...]) -> None:
    missing = missing_binaries(k8s_bin_dir(), names)
    if missing:
        _unavailable(
            f"Kubernetes binaries {missing} not in {k8s_bin_dir()}; run `make k8s-binaries`"
        )


S = TypeVar("S", EtcdServer, NatsServer)


def _start(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], S]) -> S:
    root = factory.mktemp(name)
    _LOG_DIRS.append(root)
    try:
        server = make(root)
    except FileNotFoundError as err:  # the binary is not installed
        _unavailable(str(err))
    return server.start()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = _start(tmp_path_factory, "etcd", lambda r: EtcdServer(r / "data", r / "etcd.log"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = _start(tmp_path_factory, "nats", lambda r: NatsServer(r / "js", r / "nats.log"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def kube_control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeControlPlane]:
    """kube-apiserver with its own etcd, token auth for an admin and a restricted user, RBAC."""
    _require_binaries(APISERVER_BINARIES)
    bin_dir = k8s_bin_dir()
    root = tmp_path_factory.mktemp("kube")
    _LOG_DIRS.append(root)
    plane = KubeControlPlane(root, bin_dir)
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kube_cluster(kube_control_plane: KubeControlPlane) -> KubeControlPlane:
    """The same control plane plus controller-manager, scheduler and KWOK fake-node controller."""
    _require_binaries(CLUSTER_BINARIES)
    kube_control_plane.start_cluster_components()
    return kube_control_plane


@pytest.fixture(scope="session")
def helm_binary() -> Path:
    """The helm binary built beside the Kubernetes binaries (`make k8s-binaries`)."""
    _require_binaries(("helm",))
    return k8s_bin_dir() / "helm"


@pytest.fixture(scope="session")
def gateway_api_crds() -> Path:
    """The Gateway API CRDs collected by `make k8s-binaries` (read at test time, never copied)."""
    folder = k8s_bin_dir().parent / "gateway-api"
    if not (folder / "gateway.networking.k8s.io_httproutes.yaml").is_file():
        _unavailable(f"Gateway API CRDs not in {folder}; run `make k8s-binaries`")
    return folder


GAIE_VERSION = "v1.6.0"
"""The GAIE release whose InferencePool CRD the tests install (`hack/k8s-binaries.sh`)."""


@pytest.fixture(scope="session")
def gaie_crd() -> Path:
    """GAIE's InferencePool CRD (v1), collected by `make k8s-binaries` from the GAIE module on
    the Go module proxy (read at test time, never copied: the platform installs it, not kvrail)."""
    path = (
        k8s_bin_dir().parent
        / f"gaie-{GAIE_VERSION}"
        / "inference.networking.k8s.io_inferencepools.yaml"
    )
    if not path.is_file():
        _unavailable(f"GAIE's InferencePool CRD not at {path}; run `make k8s-binaries`")
    return path


GATEWAY_BINARIES = ("envoy-gateway", "aigw-controller")
"""The gateway of the GAIE node tier (`make gaie-gateway`, in `make test`)."""
SUITE_BINARIES = ("lwepp", "echo-basic", "gaie-conformance.test")
"""GAIE's conformance suite, its picker and echo server (`make gaie-binaries`, for `make gaie`)."""


def _gaie_bin(names: tuple[str, ...], target: str) -> Path:
    cache = os.environ.get("GAIE_CACHE") or str(Path.home() / ".cache/kvrail/gaie")
    folder = Path(cache) / "bin"
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        _unavailable(f"GAIE binaries {missing} not in {folder}; run `make {target}`")
    return folder


@pytest.fixture(scope="session")
def gaie_binaries() -> Path:
    """The folder of the GAIE tier's gateway binaries: Envoy Gateway, AI Gateway's controller."""
    return _gaie_bin(GATEWAY_BINARIES, "gaie-gateway")


@pytest.fixture(scope="session")
def gaie_suite_binaries() -> Path:
    """The folder of GAIE's conformance suite binaries (and the gateway's)."""
    return _gaie_bin(GATEWAY_BINARIES + SUITE_BINARIES, "gaie-binaries")


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    """The control plane with one real node (kubelet, containerd, runc, CNI bridge, kube-proxy),
    CoreDNS, Traefik as the Gateway API implementation and kvrail's image loaded: root only.
    About 16 s to start warm; the tests leave it idle (nothing but CoreDNS and Traefik)."""
    if os.geteuid() != 0:
        _unavailable("the real node needs root (network namespaces, mounts, cgroups)")
    tools = [t for t in NODE_TOOLS if shutil.which(t) is None]
    if tools:
        _unavailable(f"the real node needs {tools}: run `make node-deps`")
    _require_binaries(
        (*APISERVER_BINARIES, "kube-controller-manager", "kube-scheduler", *NODE_BINARIES, "helm")
    )
    root = tmp_path_factory.mktemp("real-cluster")
    _LOG_DIRS.append(root)
    cache = Path(os.environ.get("KVRAIL_CACHE") or Path.home() / ".cache/kvrail")
    with real_cluster_of(root, k8s_bin_dir(), cache) as cluster:
        yield cluster


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    if exitstatus != 0 and _LOG_DIRS:
        terminalreporter.write_line("server data and logs kept in:")
        for d in _LOG_DIRS:
            terminalreporter.write_line(f"  {d}")
