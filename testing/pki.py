"""A throw-away PKI for a test control plane, made with Debian's openssl (EC P-256 keys)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvrail.tls import ServingCert

_SERVER_SANS = (
    "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
    "DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.96.0.1"
)


@dataclass(frozen=True)
class Pki:
    ca_crt: Path
    ca_key: Path
    server_crt: Path
    server_key: Path
    sa_key: Path
    sa_pub: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory: Path, extra_sans: tuple[str, ...] = ()) -> Pki:
    """CA, apiserver serving certificate (for `extra_sans` too, e.g. `IP:10.250.0.1`) and
    service-account signing key pair."""
    d = directory
    sans = ",".join((_SERVER_SANS, *extra_sans))
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
             "-subj", "/CN=kvrail-test-ca", cwd=d)  # fmt: skip
    _openssl("req", *ec, "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=d)  # fmt: skip
    (d / "server.ext").write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "apiserver.crt", "-days", "3650",
             "-extfile", "server.ext", cwd=d)  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=d)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    return Pki(d / "ca.crt", d / "ca.key", d / "apiserver.crt", d / "apiserver.key",
               d / "sa.key", d / "sa.pub")  # fmt: skip


def issue_serving_cert(
    pki: Pki, name: str, sans: str = "DNS:localhost,IP:127.0.0.1"
) -> ServingCert:
    """A serving certificate `<name>.crt` (key `<name>.key`) for `sans`, signed by the PKI's CA,
    next to it: what a local etcd or NATS serves TLS with."""
    d = pki.ca_crt.parent
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    (d / f"{name}.ext").write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "3650",
             "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return ServingCert(cert_file=d / f"{name}.crt", key_file=d / f"{name}.key", ca_file=pki.ca_crt)


@dataclass(frozen=True)
class ClientCert:
    cert_file: Path
    key_file: Path


def issue_client_cert(pki: Pki, name: str, common_name: str, organization: str) -> ClientCert:
    """A client certificate `<name>.crt` (key `<name>.key`) for user `common_name` in group
    `organization`, signed by the PKI's CA, next to it."""
    d = pki.ca_crt.parent
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/O={organization}/CN={common_name}", cwd=d)  # fmt: skip
    (d / f"{name}.ext").write_text("extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "3650",
             "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return ClientCert(cert_file=d / f"{name}.crt", key_file=d / f"{name}.key")
