"""TLS for the etcd and NATS clients: the one place that turns endpoints and CA files into TLS.

The scheme decides, and a CA file never silently goes unused:

- etcd: `https://` endpoints speak TLS, verified against `etcd_ca_file` (else the system's CAs);
  `http://` endpoints are plaintext, and a CA file with them is a `ConfigError`. All endpoints of
  one client share a scheme.
- NATS: a `tls://` URL or a CA file requires TLS, verified against `nats_ca_file` (else the
  system's CAs). NATS negotiates TLS on its one port, so `nats://` with a CA file is TLS too; a
  server that does not offer TLS then is refused (`require_nats_tls`), never used in plaintext.

A CA file that cannot be read or holds no PEM certificate is a `ConfigError` naming the file. The
server's name (host of the URL) must be in its certificate's subjectAltName.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc

from kvrail.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ServingCert:
    """The files a server serves TLS with (`kvrail.local.servers`): its certificate and key,
    and the CA that signed them (what its clients trust)."""

    cert_file: Path
    key_file: Path
    ca_file: Path


def check_etcd_endpoints(endpoints: tuple[str, ...], ca_file: Path | None) -> bool:
    """Whether the endpoints speak TLS. Raises ConfigError for mixed schemes and for a CA file
    with plaintext endpoints. Pure (the file is not read)."""
    schemes = {urlparse(e).scheme for e in endpoints}
    if len(schemes) > 1:
        raise ConfigError(f"etcd endpoints mix http:// and https://: {', '.join(endpoints)}")
    is_tls = schemes == {"https"}
    if ca_file is not None and not is_tls:
        raise ConfigError(
            f"etcd_ca_file {ca_file} is set but the etcd endpoints are plaintext http:// "
            f"({', '.join(endpoints)}): use https:// endpoints, or unset the CA file"
        )
    return is_tls


def is_nats_tls(url: str, ca_file: Path | None) -> bool:
    """Whether the NATS connection must be TLS: a `tls://` URL or a CA file. Pure."""
    return url.startswith("tls://") or ca_file is not None


def read_ca(path: Path, setting: str) -> bytes:
    """The PEM bundle of a CA file, checked to hold at least one certificate."""
    try:
        pem = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read {setting} {path}: {err.strerror}") from err
    try:
        ssl.create_default_context(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError, ValueError) as err:
        raise ConfigError(f"{setting} {path} holds no PEM CA certificate: {err}") from err
    return pem


def etcd_credentials(endpoints: tuple[str, ...], ca_file: Path | None) -> Any | None:
    """gRPC channel credentials for TLS endpoints, or None for plaintext ones."""
    if not check_etcd_endpoints(endpoints, ca_file):
        return None
    root = read_ca(ca_file, "etcd_ca_file") if ca_file is not None else None
    return grpc.ssl_channel_credentials(root_certificates=root)


def nats_ssl_context(url: str, ca_file: Path | None) -> ssl.SSLContext | None:
    """The client TLS context of a NATS connection, or None for plaintext."""
    if not is_nats_tls(url, ca_file):
        return None
    if ca_file is None:
        return ssl.create_default_context()
    return ssl.create_default_context(cadata=read_ca(ca_file, "nats_ca_file").decode("ascii"))


def require_nats_tls(url: str, server_info: dict[str, Any]) -> None:
    """Refuse a connection made without TLS to a server that did not require it (nats-py only
    upgrades when the server asks, whatever the URL or context say)."""
    if not server_info.get("tls_required"):
        raise ConfigError(
            f"NATS {url} was configured for TLS but the server does not offer it: refusing a "
            "plaintext connection"
        )
