"""The pool's Secret `<pool>-infrastructure`: the operator's own access to its default etcd and
NATS, for a pool that names no server of its own.

A Secret can only be mounted in its own namespace, so the chart's credentials (in the release
namespace) never reach a pool elsewhere. The operator knows them (its settings name the files),
so it writes a copy next to each pool that uses its servers: a username, a password and a CA per
server, whichever it has. A pool with `spec.infrastructure.etcd` (or `nats`) gets nothing for
that server: its own Secrets are used. Whoever can read Secrets in the pool's namespace then
holds the operator's access (docs/security.md).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders.context import BuildContext, SharedAccess
from kvrail.operator.builders.meta import object_meta

Service = Literal["etcd", "nats"]
SERVICES: tuple[Service, ...] = ("etcd", "nats")


def infrastructure_secret_name(pool: InferencePool) -> str:
    return f"{pool.metadata.name}-infrastructure"


def username_key(service: Service) -> str:
    return f"{service}-username"


def password_key(service: Service) -> str:
    return f"{service}-password"


def ca_key(service: Service) -> str:
    return f"{service}-ca.crt"


def shared_access(pool: InferencePool, ctx: BuildContext) -> dict[Service, SharedAccess]:
    """The operator's access the pool gets, by server: those the pool does not name itself and
    for which the operator has a credential or a CA."""
    if not ctx.share_access:
        return {}
    infra = pool.spec.infrastructure
    own = {"etcd": infra.etcd is not None, "nats": infra.nats is not None}
    access = {"etcd": ctx.etcd_access, "nats": ctx.nats_access}
    return {s: access[s] for s in SERVICES if not own[s] and access[s]}


def build_infrastructure_secret(pool: InferencePool, ctx: BuildContext) -> dict[str, Any] | None:
    """The Secret, or None when the pool needs none."""
    data: dict[str, str] = {}
    for service, access in shared_access(pool, ctx).items():
        for key, value in (
            (username_key(service), access.username),
            (password_key(service), access.password),
            (ca_key(service), access.ca_pem),
        ):
            if value is not None:
                data[key] = base64.b64encode(value.encode()).decode()
    if not data:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(pool, infrastructure_secret_name(pool), None),
        "type": "Opaque",
        "data": data,
    }
