"""kvrail.tls: which endpoints speak TLS, and the configurations refused instead of a fallback."""

from __future__ import annotations

import ssl
from pathlib import Path

import aetcd
import pytest

from kvrail.bus import connect
from kvrail.crd.infrastructure import InfrastructureSpec
from kvrail.errors import ConfigError
from kvrail.operator.planes import pool_settings
from kvrail.registry import etcd_client
from kvrail.settings import Settings, load_settings
from kvrail.testing.pki import make_pki
from kvrail.tls import check_etcd_endpoints, nats_ssl_context, read_ca

HTTPS = "https://etcd.example:2379"
HTTP = "http://etcd.example:2379"


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki")).ca_crt


@pytest.fixture
def not_pem(tmp_path: Path) -> Path:
    path = tmp_path / "ca.crt"
    path.write_text("password123\n")
    return path


@pytest.mark.parametrize(
    "env,message",
    [
        ({"KVRAIL_ETCD_CA_FILE": "/ca.crt"}, "etcd_ca_file /ca.crt is set but the etcd endpoints "
         "are plaintext http://"),
        ({"KVRAIL_ETCD_ENDPOINTS": f"{HTTPS},{HTTP}"}, "mix http:// and https://"),
    ],
)  # fmt: skip
def test_settings_refuse_a_ca_with_plaintext_etcd(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(environ=env)


def test_settings_accept_tls_without_a_ca_file() -> None:
    """The system's CAs then verify the servers (a public CA)."""
    s = load_settings(environ={"KVRAIL_ETCD_ENDPOINTS": HTTPS, "KVRAIL_NATS_URL": "tls://n:4222"})
    assert check_etcd_endpoints(s.etcd_endpoints, s.etcd_ca_file)


def test_the_etcd_client_checks_settings_copied_without_validation(ca_file: Path) -> None:
    copied = Settings().model_copy(update={"etcd_ca_file": ca_file})
    with pytest.raises(ConfigError, match="plaintext http://"):
        etcd_client(copied)


def test_the_etcd_client_speaks_tls_exactly_for_https(ca_file: Path) -> None:
    assert type(etcd_client(Settings())) is aetcd.Client
    tls = etcd_client(Settings(etcd_endpoints=(HTTPS,), etcd_ca_file=ca_file))
    assert isinstance(tls, aetcd.Client) and type(tls) is not aetcd.Client


@pytest.mark.parametrize("setting", ["etcd_ca_file", "nats_ca_file"])
def test_an_unreadable_or_empty_ca_file_is_refused(
    setting: str, tmp_path: Path, not_pem: Path
) -> None:
    with pytest.raises(ConfigError, match=f"cannot read {setting} {tmp_path}/absent.crt"):
        read_ca(tmp_path / "absent.crt", setting)
    with pytest.raises(ConfigError, match=f"{setting} {not_pem} holds no PEM CA certificate"):
        read_ca(not_pem, setting)


def test_https_etcd_with_a_missing_ca_file_is_refused(tmp_path: Path) -> None:
    s = Settings(etcd_endpoints=(HTTPS,), etcd_ca_file=tmp_path / "absent.crt")
    with pytest.raises(ConfigError, match="cannot read etcd_ca_file"):
        etcd_client(s)


async def test_nats_with_a_missing_ca_file_is_refused_before_connecting(tmp_path: Path) -> None:
    s = Settings(nats_url="tls://127.0.0.1:1", nats_ca_file=tmp_path / "absent.crt")
    with pytest.raises(ConfigError, match="cannot read nats_ca_file"):
        await connect(s, "test")


@pytest.mark.parametrize(
    "url,has_ca,is_tls",
    [
        ("nats://n:4222", False, False),
        ("nats://n:4222", True, True),  # NATS negotiates TLS on its one port
        ("tls://n:4222", False, True),  # the system's CAs
        ("tls://n:4222", True, True),
    ],
)
def test_nats_speaks_tls_for_a_tls_url_or_a_ca_file(
    url: str, has_ca: bool, is_tls: bool, ca_file: Path
) -> None:
    context = nats_ssl_context(url, ca_file if has_ca else None)
    assert (context is not None) == is_tls
    if context is not None:
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


@pytest.mark.parametrize(
    "etcd,nats,kept",
    [
        (None, None, (True, True)),  # the operator's own servers
        ([HTTPS], "tls://n:4222", (True, True)),  # the pool's, signed by the same CA
        ([HTTP], "nats://n:4222", (False, False)),  # the pool asked for plaintext
    ],
)
def test_a_pool_keeps_the_operators_ca_only_for_its_tls_servers(
    etcd: list[str] | None, nats: str | None, kept: tuple[bool, bool], ca_file: Path
) -> None:
    base = Settings(
        etcd_endpoints=(HTTPS,), etcd_ca_file=ca_file, nats_url="tls://n:4222", nats_ca_file=ca_file
    )
    infra = InfrastructureSpec.model_validate(
        {
            **({"etcd": {"endpoints": etcd}} if etcd else {}),
            **({"nats": {"url": nats}} if nats else {}),
        }
    )
    s = pool_settings(base, "ns", "pool", infra)
    assert (s.etcd_ca_file is not None, s.nats_ca_file is not None) == kept
