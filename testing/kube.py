"""A real Kubernetes control plane for tests: no images, no kubelet, no downloads.

`KubeControlPlane.start()` brings up, in the way envtest does: its own etcd, a generated PKI, a
kube-apiserver with token authentication (an admin in `system:masters` and a restricted user with
no grants) and RBAC authorization. `start_cluster_components()` adds kube-controller-manager,
kube-scheduler and KWOK, so StatefulSet pods are created, scheduled onto fake nodes by the real
scheduler and reported Running. The binaries are built from the Go module proxy by
`hack/k8s-binaries.sh` into a cache outside the repository.

Bound to 127.0.0.1 by default. A real node (`kvrail.testing.node`) needs the API server where its
kubelet and pods reach it: `address` is then the host end of the node's link, the `kubernetes`
Service gets that address as its endpoint, and `extra_users` adds the kubelet's and kube-proxy's
token identities.
"""

from __future__ import annotations

import json
import secrets
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvrail.local.procs import ManagedProcess, free_port
from kvrail.local.servers import EtcdServer
from kvrail.testing.pki import Pki, issue_client_cert, make_pki

K8S_VERSION = "v1.36.3"
ADMIN = "kvrail-admin"
RESTRICTED = "kvrail-restricted"
APISERVER_BINARIES = ("kube-apiserver", "etcd")
CLUSTER_BINARIES = ("kube-controller-manager", "kube-scheduler", "kwok")


def default_bin_dir(cache: Path) -> Path:
    return cache / K8S_VERSION / "bin"


def missing_binaries(bin_dir: Path, names: tuple[str, ...]) -> list[str]:
    return [b for b in names if not (bin_dir / b).is_file()]


@dataclass(frozen=True)
class KubeUser:
    name: str
    token: str
    kubeconfig: Path


class KubeControlPlane:
    """One control plane under `workdir`; `stop()` tears everything down in reverse order."""

    def __init__(
        self,
        workdir: Path,
        bin_dir: Path,
        address: str = "127.0.0.1",
        extra_users: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        """`extra_users`: more token identities, name -> groups (e.g. `system:node:<name>` in
        `system:nodes`); each gets a kubeconfig like the admin's."""
        self.workdir = workdir
        self.bin_dir = bin_dir
        self.address = address
        self.extra_users = dict(extra_users or {})
        self.port = free_port()
        self.server = f"https://{address}:{self.port}"
        self.users: dict[str, KubeUser] = {}
        self._etcd: EtcdServer | None = None
        self._procs: list[ManagedProcess] = []
        self._pki: Pki | None = None
        self._ssl: ssl.SSLContext | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> KubeControlPlane:
        logs = self.workdir / "logs"
        self._pki = pki = make_pki(self.workdir / "pki", extra_sans=(f"IP:{self.address}",))
        # What the API server presents to kubelets (logs, exec); system:masters passes their
        # webhook authorization.
        kubelet_client = issue_client_cert(
            pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters"
        )
        self._ssl = ssl.create_default_context(cafile=str(pki.ca_crt))
        # Its own etcd 3.6, built beside it: kube-apiserver 1.36 does not work with Debian's 3.4.
        self._etcd = EtcdServer(
            self.workdir / "etcd", logs / "etcd.log", binary=str(self.bin_dir / "etcd")
        ).start()
        groups = {ADMIN: ("system:masters",), RESTRICTED: (), **self.extra_users}
        tokens = {name: secrets.token_hex(16) for name in groups}
        (self.workdir / "tokens.csv").write_text(
            "".join(
                f'{tokens[n]},{n},{n}-uid,"{",".join(g)}"\n' if g else f"{tokens[n]},{n},{n}-uid\n"
                for n, g in groups.items()
            )
        )
        for name, token in tokens.items():
            self.users[name] = KubeUser(name, token, self._write_kubeconfig(name, token))
        argv = [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={self._etcd.endpoint}",
            f"--bind-address={self.address}",
            f"--advertise-address={self.address}",
            f"--secure-port={self.port}",
            f"--tls-cert-file={pki.server_crt}",
            f"--tls-private-key-file={pki.server_key}",
            f"--client-ca-file={pki.ca_crt}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            # The `kubernetes` Service's endpoint is the advertised address, which may not be
            # a loopback one: with the default 127.0.0.1 there is none.
            f"--endpoint-reconciler-type={'none' if self.address == '127.0.0.1' else 'lease'}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={kubelet_client.cert_file}",
            f"--kubelet-client-key={kubelet_client.key_file}",
            "--profiling=false",
            f"--cert-dir={self.workdir / 'certs'}",
            "--v=1",
        ]
        apiserver = self._spawn("kube-apiserver", argv)
        apiserver.wait_ready(lambda: self._get_status("/readyz") == 200, timeout_s, 0.25)
        return self

    def start_cluster_components(self, timeout_s: float = 120.0, kwok: bool = True) -> None:
        """kube-controller-manager, kube-scheduler and KWOK (fake nodes, pods made Running);
        `kwok=False` for a cluster whose only nodes are real."""
        assert self._pki is not None, "start() first"
        admin = self.users[ADMIN].kubeconfig
        always_allow = "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics"
        kcm_port, sched_port = free_port(), free_port()
        kcm = self._spawn("kube-controller-manager", [
            str(self.bin_dir / "kube-controller-manager"),
            f"--kubeconfig={admin}", f"--authentication-kubeconfig={admin}",
            f"--authorization-kubeconfig={admin}",
            "--bind-address=127.0.0.1", f"--secure-port={kcm_port}", "--leader-elect=false",
            "--controllers=*", f"--service-account-private-key-file={self._pki.sa_key}",
            f"--root-ca-file={self._pki.ca_crt}", "--use-service-account-credentials=false",
            always_allow, "--kube-api-qps=200", "--kube-api-burst=400",
            "--concurrent-statefulset-syncs=10", "--v=1",
        ])  # fmt: skip
        sched_cfg = self.workdir / "scheduler.yaml"
        sched_cfg.write_text(yaml.safe_dump({
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(admin), "qps": 200, "burst": 400},
            "leaderElection": {"leaderElect": False},
        }))  # fmt: skip
        sched = self._spawn("kube-scheduler", [
            str(self.bin_dir / "kube-scheduler"), f"--config={sched_cfg}",
            f"--authentication-kubeconfig={admin}", f"--authorization-kubeconfig={admin}",
            "--bind-address=127.0.0.1", f"--secure-port={sched_port}", always_allow, "--v=1",
        ])  # fmt: skip
        stages = self.bin_dir.parent / "kwok-stages.yaml"
        if kwok:
            self._spawn("kwok", [
                str(self.bin_dir / "kwok"), f"--kubeconfig={admin}", f"--config={stages}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--cidr=10.244.0.0/16", "--node-ip=10.0.0.1", "--node-lease-duration-seconds=40",
            ])  # fmt: skip
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # self-signed serving certs of KCM and scheduler
        for proc, port in ((kcm, kcm_port), (sched, sched_port)):
            proc.wait_ready(_healthz(port, insecure), timeout_s, 0.25)

    def stop(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()
        if self._etcd:
            self._etcd.stop()

    @property
    def pki(self) -> Pki:
        assert self._pki is not None, "start() first"
        return self._pki

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    def kubeconfig(self, user: str = ADMIN) -> Path:
        return self.users[user].kubeconfig

    # -- a minimal JSON client (tests use the kubernetes client; this serves the harness) --------
    def api(self, method: str, path: str, body: Any = None, user: str = ADMIN) -> Any:
        """One API call as `user`; returns the decoded JSON body, raises HTTPError on >= 400."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.users[user].token}")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, context=self._ssl, timeout=30) as resp:
            return json.loads(resp.read() or b"null")

    def add_node(
        self,
        name: str,
        labels: dict[str, str] | None = None,
        capacity: dict[str, str] | None = None,
    ) -> None:
        """A KWOK fake node with labels and extended resources (capacity == allocatable)."""
        cap = {"cpu": "64", "memory": "512Gi", "pods": "110", **(capacity or {})}
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64", "type": "kwok", **(labels or {}),
                },
            },
            "status": {"capacity": cap, "allocatable": cap},
        }  # fmt: skip
        self.api("POST", "/api/v1/nodes", node)

    # -- internals --------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.log_dir / f"{name}.log").start()
        self._procs.append(proc)
        return proc

    def _get_status(self, path: str) -> int:
        req = urllib.request.Request(self.server + path)
        req.add_header("Authorization", f"Bearer {self.users[ADMIN].token}")
        assert self._ssl is not None
        return _status(req, self._ssl)

    def _write_kubeconfig(self, user: str, token: str) -> Path:
        assert self._pki is not None
        path = self.workdir / f"{user.replace(':', '-')}.kubeconfig"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kvrail-test", "cluster": {
                "server": self.server, "certificate-authority": str(self._pki.ca_crt)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "kvrail-test", "user": user}}],
            "current-context": user,
        }  # fmt: skip
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path


def _healthz(port: int, context: ssl.SSLContext) -> Callable[[], bool]:
    url = f"https://127.0.0.1:{port}/healthz"
    return lambda: _status(url, context) == 200


def _status(url: str | urllib.request.Request, context: ssl.SSLContext) -> int:
    try:
        with urllib.request.urlopen(url, context=context, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0
