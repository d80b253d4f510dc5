"""etcd and NATS with TLS and passwords: kvrail's clients over real servers, and every refusal.

The servers serve a certificate for 127.0.0.1 signed by a throw-away CA (`kvrail.testing.pki`);
etcd has user root with a password, NATS user kvrail. Clients get everything as settings, the way
a worker gets it (`KVRAIL_*`, the password and CA as files).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aetcd.exceptions
import pytest

from kvrail.bus import PrefillQueue, connect
from kvrail.errors import ConfigError
from kvrail.keys import PoolKeys
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.messages import PrefillJob, WorkerRecord
from kvrail.operator.planes import PlaneError, Planes
from kvrail.registry import Registry, etcd_client
from kvrail.sampling import SamplingParams
from kvrail.settings import Settings, load_settings
from kvrail.testing.pki import issue_serving_cert, make_pki

PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, NatsServer]]:
    root = tmp_path_factory.mktemp("secure-planes")
    cert = issue_serving_cert(make_pki(root / "pki"), "planes")
    password_file = root / "password"
    password_file.write_text(PASSWORD + "\n")
    try:
        etcd = EtcdServer(root / "etcd", root / "etcd.log", tls=cert, password_file=password_file)
        nats = NatsServer(root / "nats", root / "nats.log", tls=cert, password_file=password_file)
    except FileNotFoundError as err:  # under CI=true a missing binary fails, as everywhere
        if os.environ.get("CI") == "true":
            pytest.fail(f"{err} (CI=true: missing prerequisites fail, they do not skip)")
        pytest.skip(str(err))
    etcd.start()
    try:
        nats.start()
        yield etcd, nats
        nats.stop()
    finally:
        etcd.stop()


@pytest.fixture
def settings(secure: tuple[EtcdServer, NatsServer]) -> Settings:
    etcd, nats = secure
    pool = f"tls-{uuid.uuid4().hex[:8]}"
    return load_settings(environ={"KVRAIL_POOL": pool, **etcd.client_env(), **nats.client_env()})


@pytest.fixture
def wrong_password(tmp_path: Path) -> Path:
    path = tmp_path / "wrong"
    path.write_text("not the password\n")
    return path


def _record(worker_id: str) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, pod_uid="uid-1", incarnation=1, role="prefill",
                        fingerprint="f" * 64)  # fmt: skip


def _job(request_id: str) -> PrefillJob:
    return PrefillJob(
        request_id=request_id, token_ids=(1, 2, 3), fingerprint="f" * 64,
        dest_worker_id="decode-0", dest_incarnation=1, dest_agent_name="a",
        dest_block_ids=(4,), first_block_index=0, deadline_unix_s=time.time() + 60,
        sampling=SamplingParams(max_tokens=1),
    )  # fmt: skip


async def _etcd_get(settings: Settings) -> Any:
    async with etcd_client(settings) as client:
        return await asyncio.wait_for(client.get(b"/probe"), 10)


async def test_secure_servers_need_tls_and_passwords(settings: Settings) -> None:
    assert settings.etcd_endpoints[0].startswith("https://")
    assert settings.nats_url.startswith("tls://")
    assert settings.etcd_ca_file is not None and settings.nats_ca_file is not None
    assert settings.etcd_password_file is not None and settings.nats_password_file is not None


async def test_a_worker_registers_watches_and_queues_jobs_over_tls(settings: Settings) -> None:
    keys = PoolKeys(settings.namespace, settings.pool)
    async with etcd_client(settings) as client:
        registry = Registry(client, keys)
        registration = await registry.register(_record("prefill-0"), ttl_s=2)
        changes = registry.watch().__aiter__()
        first = await asyncio.wait_for(anext(changes), 10)
        assert first.worker_id == "prefill-0" and first.record == _record("prefill-0")
        await registration.close()
        gone = await asyncio.wait_for(anext(changes), 10)
        assert (gone.worker_id, gone.record) == ("prefill-0", None)
        await changes.aclose()
    nc = await connect(settings, "test-secure")
    try:
        queue = PrefillQueue(nc.jetstream(), keys, ack_wait_s=5, max_deliver=2)
        await queue.ensure_stream()
        sent = _job("req-tls")
        assert await queue.publish(sent)
        consumer = await queue.consumer("prefill-0")
        got = await consumer.fetch(timeout_s=5)
        assert got is not None and got.job == sent
        await got.ack()
        await consumer.close()
        assert await queue.delete_stream()
    finally:
        await nc.close()


async def test_the_operator_planes_reach_both_servers_over_tls(settings: Settings) -> None:
    planes = Planes()
    try:
        registry = await planes.registry(settings)
        assert (await registry.workers())[0] == {}
        queue = await planes.queue(settings)
        await queue.ensure_stream()
        assert await queue.delete_stream()
    finally:
        await planes.close()


async def test_etcd_refuses_a_wrong_password(settings: Settings, wrong_password: Path) -> None:
    bad = settings.model_copy(update={"etcd_password_file": wrong_password})
    with pytest.raises(aetcd.exceptions.ClientError, match="authentication failed"):
        await _etcd_get(bad)


async def test_etcd_refuses_a_client_without_credentials(settings: Settings) -> None:
    anonymous = settings.model_copy(update={"etcd_username": None, "etcd_password_file": None})
    with pytest.raises(aetcd.exceptions.ClientError, match="user name is empty"):
        await _etcd_get(anonymous)


async def test_nats_refuses_a_wrong_password(settings: Settings, wrong_password: Path) -> None:
    bad = settings.model_copy(update={"nats_password_file": wrong_password})
    with pytest.raises(ConfigError, match="refused the credentials of user 'kvrail'"):
        await asyncio.wait_for(connect(bad, "test-wrong-password"), 10)


async def test_an_etcd_client_without_the_ca_fails_verification(settings: Settings) -> None:
    without_ca = settings.model_copy(update={"etcd_ca_file": None})  # the system's CAs
    with pytest.raises(aetcd.exceptions.ClientError, match="CERTIFICATE_VERIFY_FAILED"):
        await _etcd_get(without_ca)


async def test_a_nats_client_without_the_ca_fails_verification(settings: Settings) -> None:
    without_ca = settings.model_copy(update={"nats_ca_file": None})  # tls://, the system's CAs
    with pytest.raises(ConfigError, match="TLS failed \\(CERTIFICATE_VERIFY_FAILED\\)"):
        await asyncio.wait_for(connect(without_ca, "test-no-ca"), 10)


async def test_plaintext_urls_against_the_tls_ports_fail(settings: Settings) -> None:
    http = settings.etcd_endpoints[0].replace("https://", "http://")
    plain_etcd = settings.model_copy(update={"etcd_endpoints": (http,), "etcd_ca_file": None})
    with pytest.raises(aetcd.exceptions.ConnectionFailedError):
        await _etcd_get(plain_etcd)
    # nats:// without a CA: the server demands TLS, which the system's CAs do not verify.
    url = settings.nats_url.replace("tls://", "nats://")
    plain_nats = settings.model_copy(update={"nats_url": url, "nats_ca_file": None})
    with pytest.raises(ConfigError, match="CERTIFICATE_VERIFY_FAILED"):
        await asyncio.wait_for(connect(plain_nats, "test-plain"), 10)


async def test_a_tls_url_never_falls_back_to_a_plaintext_nats(
    settings: Settings, nats_server: NatsServer
) -> None:
    """The harness's plaintext NATS does not offer TLS: the password is never sent to it."""
    url = nats_server.url.replace("nats://", "tls://")
    for password_file in (settings.nats_password_file, None):
        tls_to_plain = settings.model_copy(
            update={"nats_url": url, "nats_password_file": password_file}
        )
        with pytest.raises(ConfigError, match="does not offer it"):
            await asyncio.wait_for(connect(tls_to_plain, "test-fallback"), 10)


async def test_the_operator_reports_an_unverifiable_server_as_a_plane_error(
    settings: Settings,
) -> None:
    planes = Planes()
    try:
        with pytest.raises(PlaneError, match="CERTIFICATE_VERIFY_FAILED"):
            await planes.queue(settings.model_copy(update={"nats_ca_file": None}))
        missing_ca = settings.model_copy(update={"etcd_ca_file": Path("/nonexistent/ca.crt")})
        with pytest.raises(PlaneError, match=r"cannot read etcd_ca_file /nonexistent/ca\.crt"):
            await planes.registry(missing_ca)
    finally:
        await planes.close()
