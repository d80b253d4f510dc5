"""`<pool>-infrastructure`: the operator's access to its default etcd and NATS, for pools that
name none of their own. Found on a real kubelet: with the chart's defaults (auth on) the
example pool's workers were refused by NATS ("credentials of user None")."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from kvrail.operator.builders.children import ChildRef, build_children, stale_children
from kvrail.operator.builders.context import BuildContext, SharedAccess
from kvrail.operator.builders.deployment import build_deployment
from kvrail.operator.builders.secret import build_infrastructure_secret
from kvrail.operator.builders.statefulset import build_statefulset
from kvrail.operator.main import shared_access
from kvrail.operator.testing import make_pool, mutate, pool_manifest
from kvrail.settings import load_settings

ETCD = SharedAccess(username="root", password="etcd-s3cret", ca_pem="-----ETCD CA-----")
NATS = SharedAccess(username="kvrail", password="nats-s3cret")
CTX = BuildContext(share_access=True, etcd_access=ETCD, nats_access=NATS)
OWN_ETCD = (
    "spec.infrastructure.etcd",
    {"endpoints": ["https://etcd.example:2379"], "credentialsSecret": "mine", "caSecret": "my-ca"},
)
OWN_NATS = ("spec.infrastructure.nats", {"url": "nats://nats.example:4222"})


def decoded(secret: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def containers(ctx: BuildContext, *changes: tuple[str, Any]) -> list[dict[str, Any]]:
    pool = make_pool(mutate(pool_manifest(), *changes))
    pods = [build_statefulset(pool, "decode", ctx), build_deployment(pool, ctx)]
    return [c for p in pods for c in p["spec"]["template"]["spec"]["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_pool_without_infrastructure_gets_the_operators_access_in_its_namespace() -> None:
    secret = build_infrastructure_secret(make_pool(), CTX)
    assert secret is not None
    assert secret["metadata"]["name"] == "tiny-infrastructure"
    assert secret["metadata"]["namespace"] == "default"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # collected with the pool
    assert decoded(secret) == {
        "etcd-username": "root", "etcd-password": "etcd-s3cret", "etcd-ca.crt": "-----ETCD CA-----",
        "nats-username": "kvrail", "nats-password": "nats-s3cret",
    }  # fmt: skip
    for container in containers(CTX):
        env = env_of(container)
        ref = {"secretKeyRef": {"name": "tiny-infrastructure", "key": "etcd-username"}}
        assert env["KVRAIL_ETCD_USERNAME"] == ref
        assert env["KVRAIL_NATS_USER"]["secretKeyRef"]["key"] == "nats-username"
        assert (
            env["KVRAIL_ETCD_PASSWORD_FILE"] == "/var/run/secrets/kvrail/etcd-credentials/password"
        )
        assert env["KVRAIL_ETCD_CA_FILE"] == "/var/run/secrets/kvrail/etcd-ca/ca.crt"
        assert "KVRAIL_NATS_CA_FILE" not in env
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/var/run/secrets/kvrail/etcd-credentials" in mounts


def test_the_volumes_map_the_secrets_keys_to_the_paths_the_settings_name() -> None:
    pool = make_pool()
    volumes = {
        v["name"]: v["secret"]
        for v in build_statefulset(pool, "decode", CTX)["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    assert volumes["etcd-credentials"]["secretName"] == "tiny-infrastructure"
    assert volumes["etcd-credentials"]["items"] == [{"key": "etcd-password", "path": "password"}]
    assert volumes["etcd-ca"]["items"] == [{"key": "etcd-ca.crt", "path": "ca.crt"}]
    assert volumes["nats-credentials"]["items"] == [{"key": "nats-password", "path": "password"}]
    assert "nats-ca" not in volumes


def test_a_pool_naming_its_own_server_gets_only_the_others_access() -> None:
    secret = build_infrastructure_secret(make_pool(mutate(pool_manifest(), OWN_ETCD)), CTX)
    assert secret is not None
    assert set(decoded(secret)) == {"nats-username", "nats-password"}
    for container in containers(CTX, OWN_ETCD):
        env = env_of(container)
        assert env["KVRAIL_ETCD_USERNAME"] == {"secretKeyRef": {"name": "mine", "key": "username"}}
        assert env["KVRAIL_ETCD_ENDPOINTS"] == "https://etcd.example:2379"


def test_a_pool_naming_both_servers_gets_no_secret_and_an_old_one_is_stale() -> None:
    pool = make_pool(mutate(pool_manifest(), OWN_ETCD, OWN_NATS))
    assert build_infrastructure_secret(pool, CTX) is None
    assert ChildRef("v1", "Secret", "tiny-infrastructure") in stale_children(pool, CTX)
    assert "tiny-infrastructure" not in json.dumps(build_children(pool, CTX))


@pytest.mark.parametrize(
    "ctx",
    [BuildContext(), BuildContext(share_access=False, etcd_access=ETCD, nats_access=NATS),
     BuildContext(share_access=True)],
    ids=["default", "sharing-off", "nothing-to-share"],
)  # fmt: skip
def test_without_access_to_share_pools_get_endpoints_alone(ctx: BuildContext) -> None:
    pool = make_pool()
    assert build_infrastructure_secret(pool, ctx) is None
    for container in containers(ctx):
        credentials = {
            n for n in env_of(container) if n.startswith(("KVRAIL_ETCD_", "KVRAIL_NATS_"))
        }
        assert credentials == {"KVRAIL_ETCD_ENDPOINTS", "KVRAIL_NATS_URL"}
    # Off: no Secret is ever touched (the chart grants no RBAC on Secrets then).
    stale = {r.kind for r in stale_children(pool, ctx)}
    assert ("Secret" in stale) == ctx.share_access


def test_passwords_appear_only_in_the_secret_and_never_in_a_repr() -> None:
    children = build_children(make_pool(), CTX)
    others = [c for c in children if c["kind"] != "Secret"]
    text = json.dumps(others)
    assert "s3cret" not in text
    assert "s3cret" not in repr(CTX)


def test_the_operator_reads_its_access_from_the_files_its_settings_name(tmp_path: Path) -> None:
    (tmp_path / "etcd-password").write_text("etcd-s3cret\n")
    (tmp_path / "ca.crt").write_text("-----ETCD CA-----\n")
    environ = {
        "KVRAIL_ETCD_USERNAME": "root",
        "KVRAIL_ETCD_PASSWORD_FILE": str(tmp_path / "etcd-password"),
        "KVRAIL_ETCD_CA_FILE": str(tmp_path / "ca.crt"),
        "KVRAIL_ETCD_ENDPOINTS": "https://etcd:2379",
    }
    etcd, nats = shared_access(load_settings(environ=environ))
    assert etcd == SharedAccess("root", "etcd-s3cret", "-----ETCD CA-----")
    assert not nats
    off = load_settings(environ={**environ, "KVRAIL_OPERATOR_SHARE_ACCESS": "false"})
    assert shared_access(off) == (SharedAccess(), SharedAccess())
