"""`python -P -m kvrail.etcd_auth` (the chart's etcd auth Job) against a real etcd.

Each test has an etcd of its own without authentication, as the chart's StatefulSet starts it.
The module gets the password as a file and must leave etcd requiring it, wait for a server
that is not up yet, accept a run cut short before, and refuse a second run whose password does
not log in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from aetcd.rpc import AuthStub, KVStub
from aetcd.rpc import rpc_pb2 as pb

from kvrail.etcd_auth import ROOT, channel
from kvrail.local.servers import EtcdServer

PASSWORD = '9 lives: {not} a "config" value'  # a digit first, braces, quotes, spaces


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    try:
        server = EtcdServer(tmp_path / "etcd", tmp_path / "etcd.log")
    except FileNotFoundError as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{err} (CI=true: missing prerequisites fail, they do not skip)")
        pytest.skip(str(err))
    yield server
    server.stop()


def _password_file(folder: Path, password: str) -> Path:
    path = folder / "password"
    path.write_text(password + "\n")  # as a Secret's key often ends
    return path


def _run(etcd: EtcdServer, password_file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-P", "-m", "kvrail.etcd_auth", f"--endpoint={etcd.endpoint}",
            *extra, str(password_file)]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def _put(etcd: EtcdServer, token: str | None) -> None:
    """A write as a client with `token` (None: anonymous); raises grpc.RpcError if refused."""
    with channel(etcd.endpoint) as chan:
        metadata = (("token", token),) if token else None
        KVStub(chan).Put(pb.PutRequest(key=b"k", value=b"v"), timeout=10, metadata=metadata)


def _login(etcd: EtcdServer, password: str) -> str:
    with channel(etcd.endpoint) as chan:
        reply = AuthStub(chan).Authenticate(
            pb.AuthenticateRequest(name=ROOT, password=password), timeout=10
        )
        return str(reply.token)


def test_waits_for_etcd_then_requires_the_password(etcd: EtcdServer, tmp_path: Path) -> None:
    argv = [sys.executable, "-P", "-m", "kvrail.etcd_auth", f"--endpoint={etcd.endpoint}",
            str(_password_file(tmp_path, PASSWORD))]  # fmt: skip
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stderr is not None
        assert "waiting for etcd (UNAVAILABLE: " in job.stderr.readline()
        etcd.start()  # after the Job has found no etcd: it waits for it to answer
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, err
    assert "authentication enabled" in out
    assert PASSWORD not in out + err
    with pytest.raises(grpc.RpcError) as refused:
        _put(etcd, None)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # "user name is empty"
    _put(etcd, _login(etcd, PASSWORD))  # the file's password, without its trailing newline


def test_runs_again_and_refuses_another_password(etcd: EtcdServer, tmp_path: Path) -> None:
    etcd.start()
    assert _run(etcd, _password_file(tmp_path, PASSWORD)).returncode == 0
    again = _run(etcd, _password_file(tmp_path, PASSWORD))
    assert again.returncode == 0, again.stderr
    assert "already enabled" in again.stdout
    other = _run(etcd, _password_file(tmp_path, "another one"))
    assert other.returncode == 1
    assert "does not log in as root" in other.stderr
    assert "another one" not in other.stdout + other.stderr
    _login(etcd, PASSWORD)  # unchanged


def test_finishes_a_run_cut_short_with_the_files_password(etcd: EtcdServer, tmp_path: Path) -> None:
    etcd.start()
    with channel(etcd.endpoint) as chan:  # an earlier run added root, then stopped
        auth = AuthStub(chan)
        auth.RoleAdd(pb.AuthRoleAddRequest(name=ROOT), timeout=10)
        auth.UserAdd(pb.AuthUserAddRequest(name=ROOT, password="an older one"), timeout=10)
    done = _run(etcd, _password_file(tmp_path, PASSWORD))
    assert done.returncode == 0, done.stderr
    _put(etcd, _login(etcd, PASSWORD))


def test_refuses_an_empty_password_and_gives_up_on_an_absent_etcd(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    empty = _run(etcd, _password_file(tmp_path, ""))
    assert empty.returncode == 2
    assert "is empty" in empty.stderr
    absent = _run(etcd, _password_file(tmp_path, PASSWORD), "--wait-s=1")  # never started
    assert absent.returncode == 1
    assert "did not answer within 1 s (UNAVAILABLE: " in absent.stderr
