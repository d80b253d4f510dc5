"""Turns on an etcd server's authentication with a password from a file.

etcd enables authentication through its API, not a flag: user `root` with role `root`, then
`AuthEnable`. The chart's post-install Job runs

    python -P -m kvrail.etcd_auth --endpoint URL [--ca-file CA] PASSWORD_FILE

with the credentials Secret mounted as a file, so the password is in no process's command line
or environment (etcdctl takes it only as an argument or on a terminal). It waits for the
server to answer, then adds what is missing: it can run again after any step failed. When
authentication is already on, it checks that the password logs in as root and changes nothing.
`kvrail.local.servers.EtcdServer` enables a local server's authentication the same way.

Exit status: 0 done (or already done), 1 etcd refused a step or never answered, 2 the password
file or the arguments are wrong. The password is never printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import grpc
from aetcd.rpc import AuthStub, StatusCode
from aetcd.rpc import rpc_pb2 as pb

from kvrail.errors import ConfigError
from kvrail.settings import read_secret
from kvrail.tls import etcd_credentials

ROOT = "root"  # etcd's own name for the user and role that authentication requires
_EXISTS = StatusCode.FAILED_PRECONDITION  # etcd's answer to adding a user or role twice


class EtcdAuthError(Exception):
    """etcd refused a step, or its authentication is on with another root password."""


def channel(endpoint: str, ca_file: Path | None = None) -> grpc.Channel:
    """A gRPC channel to `endpoint` (`http://` or `https://` host:port), TLS with `ca_file`
    (or the system's CAs) for https. Raises ConfigError for a CA file with plaintext."""
    credentials = etcd_credentials((endpoint,), ca_file)
    url = urlparse(endpoint)
    target = f"{url.hostname or '127.0.0.1'}:{url.port or 2379}"
    if credentials is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, credentials)


def enable_auth(chan: grpc.Channel, password: str, timeout_s: float = 10.0) -> bool:
    """User `root` with `password` and role `root`, then authentication on; False when it was
    on already and `password` logs in as root. Each step that was done before is accepted, so a
    run cut short can run again. Raises EtcdAuthError, grpc.RpcError (etcd unreachable)."""
    auth = AuthStub(chan)
    if _is_enabled(auth, password, timeout_s):
        return False
    try:
        auth.RoleAdd(pb.AuthRoleAddRequest(name=ROOT), timeout=timeout_s)
    except grpc.RpcError as err:
        if err.code() != _EXISTS:
            raise
    try:
        auth.UserAdd(pb.AuthUserAddRequest(name=ROOT, password=password), timeout=timeout_s)
    except grpc.RpcError as err:  # an earlier run added it: its password becomes this one
        if err.code() != _EXISTS:
            raise
        auth.UserChangePassword(
            pb.AuthUserChangePasswordRequest(name=ROOT, password=password), timeout=timeout_s
        )
    auth.UserGrantRole(pb.AuthUserGrantRoleRequest(user=ROOT, role=ROOT), timeout=timeout_s)
    auth.AuthEnable(pb.AuthEnableRequest(), timeout=timeout_s)
    return True


def _is_enabled(auth: AuthStub, password: str, timeout_s: float) -> bool:
    """Whether authentication is on (and `password` logs in as root), by logging in: etcd
    answers FAILED_PRECONDITION while it is off (`AuthStatus` is not in etcd 3.4). Raises
    EtcdAuthError when it is on and the password does not log in."""
    try:
        auth.Authenticate(pb.AuthenticateRequest(name=ROOT, password=password), timeout=timeout_s)
    except grpc.RpcError as err:
        if err.code() == StatusCode.FAILED_PRECONDITION:  # "authentication is not enabled"
            return False
        if err.code() == StatusCode.INVALID_ARGUMENT:  # "authentication failed"
            raise EtcdAuthError(
                f"authentication is on, but the password does not log in as {ROOT}: it was "
                "enabled with another password"
            ) from None
        raise
    return True


_NOT_ANSWERING = (StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED)


def wait_until_answering(chan: grpc.Channel, wait_s: float, every_s: float = 2.0) -> None:
    """Return once etcd answers on `chan`, whatever it answers (each try that fails is
    printed); raise EtcdAuthError after `wait_s` without an answer."""
    deadline = time.monotonic() + wait_s
    probe = pb.AuthenticateRequest(name=ROOT, password="")  # refused, but answered
    while True:
        try:
            AuthStub(chan).Authenticate(probe, timeout=every_s + 3)
            return
        except grpc.RpcError as err:
            if err.code() not in _NOT_ANSWERING:
                return
            # The details say why (refused, no such host, a TLS handshake that failed); this
            # probe carries no password, so they quote none.
            why = f"{err.code().name}: {(err.details() or '')[:300]}"
            if time.monotonic() + every_s > deadline:
                raise EtcdAuthError(f"etcd did not answer within {wait_s:g} s ({why})") from None
            print(f"kvrail.etcd_auth: waiting for etcd ({why})", file=sys.stderr)
            time.sleep(every_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -P -m kvrail.etcd_auth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "password_file", type=Path, help="root's password (without one trailing newline)"
    )
    parser.add_argument("--endpoint", required=True, help="http://host:port or https://...")
    parser.add_argument("--ca-file", type=Path, help="the CA of an https endpoint")
    parser.add_argument(
        "--wait-s", type=float, default=300.0, help="how long to wait for etcd (default 300)"
    )
    args = parser.parse_args(argv)
    try:
        password = read_secret(args.password_file)
        if not password:
            raise ConfigError(f"{args.password_file} is empty")
        chan = channel(args.endpoint, args.ca_file)
    except ConfigError as err:
        print(f"kvrail.etcd_auth: {err}", file=sys.stderr)
        return 2
    try:
        with chan:
            wait_until_answering(chan, args.wait_s)
            changed = enable_auth(chan, password)
    except EtcdAuthError as err:
        print(f"kvrail.etcd_auth: {err}", file=sys.stderr)
        return 1
    except grpc.RpcError as err:
        print(f"kvrail.etcd_auth: etcd refused a step: {err.code().name}", file=sys.stderr)
        return 1
    done = "enabled" if changed else "was already enabled"
    print(f"kvrail.etcd_auth: authentication {done} on {args.endpoint} (user {ROOT})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
