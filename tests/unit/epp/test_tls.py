"""kvrail.epp.tls: the self-signed certificate, a certificate directory read and re-read, and
the errors that name the file. The TLS handshakes themselves run in
tests/integration/test_epp_envoy.py (a client trusting the served certificate, a rotated one)
and test_epp_kvrail.py (Envoy connecting as GAIE's gateways do)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from kvrail.epp.tls import _Reloading, read_pair, self_signed, server_credentials
from kvrail.errors import ConfigError


def write(cert_dir: Path, key: bytes, cert: bytes, mtime: float | None = None) -> None:
    (cert_dir / "tls.key").write_bytes(key)
    (cert_dir / "tls.crt").write_bytes(cert)
    if mtime is not None:
        for name in ("tls.key", "tls.crt"):
            os.utime(cert_dir / name, (mtime, mtime))


def test_a_self_signed_certificate_names_its_hosts_and_matches_its_key(tmp_path: Path) -> None:
    key, cert = self_signed(["localhost", "10.0.0.7", "fd00::7"])
    parsed = x509.load_pem_x509_certificate(cert)
    sans = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.7"),
        ipaddress.ip_address("fd00::7"),
    ]
    assert parsed.issuer == parsed.subject
    write(tmp_path, key, cert)
    assert read_pair(tmp_path) == (key, cert)  # the key is the certificate's
    assert isinstance(server_credentials(None), grpc.ServerCredentials)
    assert isinstance(server_credentials(tmp_path), grpc.ServerCredentials)


def test_a_bad_certificate_directory_names_the_file(tmp_path: Path) -> None:
    key, cert = self_signed(["localhost"])
    other_key, _ = self_signed(["localhost"])
    with pytest.raises(ConfigError, match=r"cannot read .*tls\.key"):
        read_pair(tmp_path)
    write(tmp_path, key, b"not a certificate")
    with pytest.raises(ConfigError, match=r"tls\.crt holds no PEM certificate"):
        read_pair(tmp_path)
    write(tmp_path, cert, cert)
    with pytest.raises(ConfigError, match=r"tls\.key holds no unencrypted PEM private key"):
        read_pair(tmp_path)
    write(tmp_path, other_key, cert)
    with pytest.raises(ConfigError, match=r"tls\.key is not the key of .*tls\.crt"):
        read_pair(tmp_path)
    with pytest.raises(ConfigError, match="not the key"):
        server_credentials(tmp_path)  # at start: the EPP does not serve a mismatched pair


def test_a_changed_directory_gives_a_new_configuration_once_it_is_whole(tmp_path: Path) -> None:
    key, cert = self_signed(["localhost"])
    write(tmp_path, key, cert, mtime=1_000)
    fetch = _Reloading(tmp_path)
    assert fetch() is None  # unchanged
    new_key, new_cert = self_signed(["localhost"])
    write(tmp_path, new_key, cert, mtime=2_000)  # caught half-written: the old pair stays
    assert fetch() is None
    write(tmp_path, new_key, new_cert, mtime=3_000)
    assert fetch() is not None
    assert fetch() is None  # taken once
    (tmp_path / "tls.crt").unlink()  # gone: the last pair stays
    assert fetch() is None
