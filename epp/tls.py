"""TLS on the EPP's ext_proc port (``--secure-serving``, the default, as GAIE's own picker).

Gateways that implement GAIE connect to an endpoint picker over TLS without verifying its
certificate (the GAIE picker serves a self-signed one), so a picker that spoke plaintext there
would fail every handshake. The certificate comes from ``--cert-path`` (a directory holding
``tls.crt`` and ``tls.key``, such as a mounted ``kubernetes.io/tls`` Secret), re-read when either
file changes (checked at each new connection: a rotated Secret takes effect without a restart),
or, without it, is made at start-up: a self-signed EC P-256 certificate, in memory only.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from collections.abc import Sequence
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvrail.errors import ConfigError

CERT_FILE, KEY_FILE = "tls.crt", "tls.key"
SELF_SIGNED_DAYS = 365


def self_signed(hosts: Sequence[str]) -> tuple[bytes, bytes]:
    """A self-signed certificate for ``hosts`` (names or IP addresses) and its key, both PEM:
    ``(key, certificate)``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrail-epp")])
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def read_pair(cert_dir: Path) -> tuple[bytes, bytes]:
    """``(key, certificate)`` PEM from ``cert_dir``; ConfigError naming the file that is missing,
    unreadable or not PEM of its kind, or a key that is not the certificate's."""
    key_path, cert_path = cert_dir / KEY_FILE, cert_dir / CERT_FILE
    key_pem, cert_pem = _read(key_path), _read(cert_path)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"--cert-path: {key_path} holds no unencrypted PEM private key") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise ConfigError(f"--cert-path: {cert_path} holds no PEM certificate") from None
    if key.public_key() != cert.public_key():
        raise ConfigError(f"--cert-path: {key_path} is not the key of {cert_path}")
    return key_pem, cert_pem


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"--cert-path: cannot read {path}: {e.strerror}") from None


class _Reloading:
    """gRPC's certificate fetcher over a directory: a new configuration when a file changed."""

    def __init__(self, cert_dir: Path) -> None:
        self._dir = cert_dir
        self._seen = self._stamp()

    def _stamp(self) -> tuple[float, ...]:
        try:
            return tuple((self._dir / n).stat().st_mtime for n in (CERT_FILE, KEY_FILE))
        except OSError:
            return ()

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self._stamp()
        if not stamp or stamp == self._seen:
            return None
        try:  # a pair caught half-written stays the old one until both are whole
            pair = read_pair(self._dir)
        except ConfigError:
            return None
        self._seen = stamp
        return grpc.ssl_server_certificate_configuration([pair])


def server_credentials(cert_dir: Path | None) -> grpc.ServerCredentials:
    """TLS credentials from ``cert_dir`` (re-read when its files change), or self-signed."""
    if cert_dir is None:
        pair = self_signed(["localhost", socket.gethostname()])
        return grpc.ssl_server_credentials([pair])
    initial = grpc.ssl_server_certificate_configuration([read_pair(cert_dir)])
    return grpc.dynamic_ssl_server_credentials(initial, _Reloading(cert_dir))
