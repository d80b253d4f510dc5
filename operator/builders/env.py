"""The environment and credential mounts of worker and router containers.

Every `KVRAIL_*` variable set here is read by `kvrail.settings` (field name in upper case), which
refuses unknown ones (a test keeps the two in step). Credentials never appear as values: Secrets
are mounted as files and the settings get the file paths. Pod identity (name, IP, UID, node)
comes from the downward API.
"""

from __future__ import annotations

from typing import Any

from kvrail.crd.chat import CHAT_TEMPLATE_KEY
from kvrail.crd.infrastructure import EndpointSpec
from kvrail.crd.pool import InferencePool
from kvrail.crd.spec import RoleSpec
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.meta import ROUTER_PORT, WORKER_PORT, model_hash
from kvrail.operator.builders.placement import ucx_tls
from kvrail.operator.builders.secret import (
    Service,
    ca_key,
    infrastructure_secret_name,
    password_key,
    shared_access,
    username_key,
)
from kvrail.operator.builders.tiers import tier_settings
from kvrail.settings import format_scorers

SECRETS_DIR = "/var/run/secrets/kvrail"
CACHE_DIR = "/var/cache/kvrail"
API_KEYS_DIR = "/etc/kvrail/api-keys"
CHAT_TEMPLATE_DIR = "/etc/kvrail/chat-template"
CHAT_TEMPLATE_VOLUME = "chat-template"


def setting(name: str, value: object) -> dict[str, Any]:
    """One `KVRAIL_<NAME>` variable with a literal value."""
    return {"name": f"KVRAIL_{name.upper()}", "value": str(value)}


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": f"KVRAIL_{name.upper()}", "valueFrom": {"fieldRef": {"fieldPath": path}}}


def identity_env(pool: InferencePool) -> list[dict[str, Any]]:
    """Pool, namespace and the pod's own name, IP, UID and node."""
    return [
        setting("pool", pool.metadata.name),
        _field("namespace", "metadata.namespace"),
        _field("pod_name", "metadata.name"),
        _field("pod_ip", "status.podIP"),
        _field("pod_uid", "metadata.uid"),
        _field("node_name", "spec.nodeName"),
    ]


def infrastructure(
    pool: InferencePool, ctx: BuildContext
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(env, volumes, volumeMounts) for etcd and NATS: endpoints and credential files, from the
    pool's own Secrets for a server it names, else from `<pool>-infrastructure` (the operator's
    access to its default servers, `builders.secret`) when the operator has any."""
    infra = pool.spec.infrastructure
    endpoints = infra.etcd.endpoints if infra.etcd else list(ctx.etcd_endpoints)
    env = [
        setting("etcd_endpoints", ",".join(endpoints)),
        setting("nats_url", infra.nats.url if infra.nats else ctx.nats_url),
    ]
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    shared = shared_access(pool, ctx)
    shared_secret = infrastructure_secret_name(pool)
    servers: tuple[tuple[Service, str, EndpointSpec | None], ...] = (
        ("etcd", "etcd_username", infra.etcd),
        ("nats", "nats_user", infra.nats),
    )
    for service, user_field, spec in servers:
        files = _Files(service, user_field, env, volumes, mounts)
        if spec is not None:
            if spec.credentials_secret:
                files.credentials(spec.credentials_secret, "username", "password")
            if spec.ca_secret:
                files.ca(spec.ca_secret, "ca.crt")
        elif service in shared:
            access = shared[service]
            if access.username is not None or access.password is not None:
                files.credentials(
                    shared_secret,
                    username_key(service) if access.username is not None else None,
                    password_key(service) if access.password is not None else None,
                )
            if access.ca_pem is not None:
                files.ca(shared_secret, ca_key(service))
    return env, volumes, mounts


class _Files:
    """Adds one server's credential env, volumes and mounts (paths are the same whichever
    Secret they come from)."""

    def __init__(
        self,
        service: Service,
        user_field: str,
        env: list[dict[str, Any]],
        volumes: list[dict[str, Any]],
        mounts: list[dict[str, Any]],
    ) -> None:
        self.service, self.user_field = service, user_field
        self.env, self.volumes, self.mounts = env, volumes, mounts

    def credentials(self, secret: str, user_item: str | None, password_item: str | None) -> None:
        if user_item is not None:
            self.env.append(
                {
                    "name": f"KVRAIL_{self.user_field.upper()}",
                    "valueFrom": {"secretKeyRef": {"name": secret, "key": user_item}},
                }
            )
        if password_item is not None:
            volume = f"{self.service}-credentials"
            path = f"{SECRETS_DIR}/{volume}/password"
            self.env.append(setting(f"{self.service}_password_file", path))
            self.volumes.append(_secret_volume(volume, secret, password_item, "password"))
            self.mounts.append(_mount(volume))

    def ca(self, secret: str, item: str) -> None:
        volume = f"{self.service}-ca"
        self.env.append(setting(f"{self.service}_ca_file", f"{SECRETS_DIR}/{volume}/ca.crt"))
        self.volumes.append(_secret_volume(volume, secret, item, "ca.crt"))
        self.mounts.append(_mount(volume))


def _secret_volume(volume: str, secret: str, key: str, path: str) -> dict[str, Any]:
    return {
        "name": volume,
        "secret": {
            "secretName": secret,
            "items": [{"key": key, "path": path}],
            "defaultMode": 0o440,
        },
    }


def _mount(volume: str) -> dict[str, Any]:
    return {"name": volume, "mountPath": f"{SECRETS_DIR}/{volume}", "readOnly": True}


def model_env(pool: InferencePool) -> list[dict[str, Any]]:
    """What every component must agree on about the model (the fingerprint-relevant settings)."""
    model = pool.spec.model
    out = [
        setting("model", model.source),
        setting("dtype", model.dtype),
        setting("kv_dtype", model.dtype if model.kv_dtype == "auto" else model.kv_dtype),
        setting("quantization", model.quantization),
        setting("block_size", model.block_size),
        setting("max_model_len", model.max_model_len),
        setting("tensor_parallel_size", pool.spec.decode.tensor_parallel_size),
        setting("model_hash", model_hash(pool)),
    ]
    if model.revision:
        out.append(setting("model_revision", model.revision))
    if model.served_name:
        out.append(setting("served_model_name", model.served_name))
    return out


def worker_env(pool: InferencePool, spec: RoleSpec, ctx: BuildContext) -> list[dict[str, Any]]:
    """The whole worker environment except credentials (see `infrastructure`)."""
    dis = pool.spec.disaggregation
    topology = pool.spec.topology
    env = [
        *identity_env(pool),
        *infrastructure(pool, ctx)[0],
        *model_env(pool),
        setting("max_num_seqs", spec.max_num_seqs),
        setting("max_num_batched_tokens", spec.max_num_batched_tokens),
        setting("disaggregation_mode", dis.mode),
        setting("kv_load_failure_policy", dis.kv_load_failure_policy),
        setting("transfer_backend", dis.transfer_backend),
        setting("rdma", topology.rdma),
        setting("http_port", WORKER_PORT),
        setting("cache_dir", CACHE_DIR),
        setting("drain_timeout_s", drain_timeout_s(spec.termination_grace_period_seconds)),
        *ucx_env(pool, spec),
        *(setting(name, value) for name, value in tier_settings(spec)),
    ]
    if pool.spec.security.zero_kv_on_release:
        env.append(setting("zero_kv_on_release", "true"))
    return merge_env(env, [e.model_dump(mode="json") for e in spec.env])


def ucx_env(pool: InferencePool, spec: RoleSpec) -> list[dict[str, Any]]:
    """UCX's transports (no TCP when RDMA is required) and devices: what NIXL runs on, for
    kvrail's workers and vLLM's NIXL connector alike."""
    env = [{"name": "UCX_TLS", "value": ucx_tls(pool, spec)}]
    if pool.spec.topology.ucx_net_devices:
        env.append({"name": "UCX_NET_DEVICES", "value": pool.spec.topology.ucx_net_devices})
    return env


def drain_timeout_s(grace_period_s: int) -> int:
    """The part of the pod's termination grace period a worker spends letting in-flight work
    finish after SIGTERM; the rest (10 s, or a fifth of a short period) is for failing what is
    left cleanly and deregistering before the kubelet's SIGKILL."""
    return max(grace_period_s - 10, grace_period_s * 4 // 5)


def router_env(pool: InferencePool, ctx: BuildContext) -> list[dict[str, Any]]:
    dis = pool.spec.disaggregation
    env = [
        *identity_env(pool),
        *infrastructure(pool, ctx)[0],
        *model_env(pool),
        setting("disaggregation_mode", dis.mode),
        setting("min_remote_prefill_tokens", dis.min_remote_prefill_tokens),
        setting("kv_load_failure_policy", dis.kv_load_failure_policy),
        setting("router_policy", pool.spec.router.policy),
        setting("router_host", "0.0.0.0"),
        setting("http_port", ROUTER_PORT),
        setting("cache_dir", CACHE_DIR),
    ]
    if pool.spec.router.scorers:
        env.append(setting("router_scorers", format_scorers(pool.spec.router.scorers)))
    if pool.spec.security.api_keys_secret:
        env.append(setting("api_keys_file", f"{API_KEYS_DIR}/api-keys.yaml"))
    return env + chat_env(pool)


def chat_env(pool: InferencePool) -> list[dict[str, Any]]:
    """The router's chat template file (mounted by `chat_template_volume`) and parsers, for
    both engines (the router renders and parses for vLLM pools too). A parser left `auto` sets
    nothing, the settings' own default, so pools that never set one keep their pod template."""
    model = pool.spec.model
    env = []
    if model.chat_template is not None:
        env.append(setting("chat_template", f"{CHAT_TEMPLATE_DIR}/{CHAT_TEMPLATE_KEY}"))
    if model.tool_call_parser != "auto":
        env.append(setting("tool_call_parser", model.tool_call_parser))
    if model.reasoning_parser != "auto":
        env.append(setting("reasoning_parser", model.reasoning_parser))
    return env


def chat_template_volume(
    pool: InferencePool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) of the router for `spec.model.chatTemplate`: the ConfigMap's one
    key as `chat_template.jinja`, whatever the key's name; none without a template. A missing
    ConfigMap or key keeps the router's pods from starting, with an event naming it."""
    template = pool.spec.model.chat_template
    if template is None:
        return [], []
    ref = template.config_map_key_ref
    volume = {
        "name": CHAT_TEMPLATE_VOLUME,
        "configMap": {
            "name": ref.name,
            "items": [{"key": ref.key, "path": CHAT_TEMPLATE_KEY}],
            "defaultMode": 0o444,
        },
    }
    mount = {"name": CHAT_TEMPLATE_VOLUME, "mountPath": CHAT_TEMPLATE_DIR, "readOnly": True}
    return [volume], [mount]


def merge_env(base: list[dict[str, Any]], extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`base` with `extra` overriding by name; names stay unique (server-side apply needs it)."""
    merged = {e["name"]: e for e in base}
    for e in extra:
        merged[e["name"]] = e
    return list(merged.values())
