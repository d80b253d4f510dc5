"""The worker's HTTP port: probes see readiness, not just a listening socket. Found on a real
kubelet: the port served Prometheus' handler, which answers 200 on every path, so workers were
Ready while still loading and even while NATS refused them."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvrail.worker import health


@pytest.fixture
def port() -> Iterator[int]:
    server = health.serve(0, addr="127.0.0.1")
    yield int(server.server_address[1])
    server.shutdown()
    health.set_ready(False)


def status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def test_readyz_is_503_until_the_worker_is_ready_and_again_once_it_drains(port: int) -> None:
    assert status(port, "/readyz") == 503
    health.set_ready(True)
    assert status(port, "/readyz") == 200
    health.set_ready(False)
    assert status(port, "/readyz") == 503


def test_livez_and_metrics_answer_and_other_paths_are_not_found(port: int) -> None:
    assert status(port, "/livez") == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert b"kvrail_" in resp.read()
    assert status(port, "/ready") == 404
    assert status(port, "/") == 404
