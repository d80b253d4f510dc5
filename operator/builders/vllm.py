"""The containers of a vLLM pool's worker pods: `vllm serve` (`engine`) and the kvrail `agent`.

The `engine` container runs the command line `kvrail.vllm.serve` builds from the pool's fields,
with vLLM's NIXL connector in disaggregated mode. It gets what kvrail's own worker gets: the
role's resources and GPUs, the scratch and model volumes, the UCX transports (so `rdma: required`
still leaves TCP out), and the role's `env` last; it gets no etcd or NATS credentials, which only
the agent uses. vLLM listens on the pod IP (port 8000: API and `/health`; 5600: NIXL side
channel, announced to peers as the pod IP from the downward API).

The `agent` container (the kvrail image, `python -P -m kvrail.agent`) registers the server
in etcd as a worker of the pool (its role, `http://<pod ip>:8000`) and publishes its load. It is
a plain container, not a native sidecar: on deletion both get SIGTERM at once, so the agent can
withdraw the registration while vLLM still answers, instead of outliving it.

vLLM runs under the pool's non-root UID with a read-only root filesystem, so HOME points at the
writable cache volume (Hugging Face, Triton and torch caches) and USER is set (torch's compile
cache asks for the user name, and a UID without a passwd entry has none). vLLM's usage
statistics are off: an operator does not phone home for its users (`env` can turn them on).
"""

from __future__ import annotations

from typing import Any, Final

from kvrail.crd.pool import InferencePool, Role
from kvrail.crd.spec import RoleSpec
from kvrail.operator.builders import placement
from kvrail.operator.builders.context import BuildContext
from kvrail.operator.builders.env import (
    CACHE_DIR,
    identity_env,
    infrastructure,
    merge_env,
    model_env,
    setting,
    ucx_env,
)
from kvrail.operator.builders.pod import (
    WorkerVolumes,
    container_security_context,
    http_probe,
    image,
    process_role,
)
from kvrail.vllm.serve import (
    DEFAULT_VLLM_IMAGE,
    NIXL_SIDE_CHANNEL_PORT,
    SIDE_CHANNEL_HOST_ENV,
    VLLM_PORT,
    ServeConfig,
    serve_argv,
    serve_env,
    served_model_name,
)

ENGINE_CONTAINER: Final = "engine"
AGENT_CONTAINER: Final = "agent"
AGENT_COMMAND: Final = ("python", "-P", "-m", "kvrail.agent")
AGENT_RESOURCES: Final = {"requests": {"cpu": "50m", "memory": "128Mi"},
                          "limits": {"memory": "256Mi"}}  # fmt: skip
"""The agent only talks to etcd, NATS and vLLM on localhost."""
STARTUP_PROBE_PERIOD_S: Final = 10
STARTUP_PROBE_FAILURES: Final = 180
"""30 min for vLLM to load the weights, compile and capture CUDA graphs before liveness counts."""
ENGINE_USER: Final = "kvrail"


def vllm_image(pool: InferencePool) -> str:
    return pool.spec.engine.image or DEFAULT_VLLM_IMAGE


def vllm_url() -> str:
    """Where the agent reaches vLLM: the same pod, so localhost."""
    return f"http://127.0.0.1:{VLLM_PORT}"


def serve_config(pool: InferencePool, role: Role, spec: RoleSpec) -> ServeConfig:
    """The role's `vllm serve` settings, from the same fields kvrail's own workers read."""
    model = pool.spec.model
    return ServeConfig(
        model=model.source,
        served_model_name=served_model_name(model.source, model.served_name),
        role=process_role(pool, role),
        dtype=model.dtype,
        kv_dtype=model.kv_dtype,
        quantization=model.quantization,
        block_size=model.block_size,
        max_model_len=model.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        tensor_parallel_size=spec.gpus or 1,
        kv_load_failure_policy=pool.spec.disaggregation.kv_load_failure_policy,
        kv_buffer_device="cuda" if spec.gpus else "cpu",
        kv_host_tier_bytes=spec.kv_tiers.host_bytes,
        kv_disk_tier_bytes=spec.kv_tiers.disk_bytes,
        extra_args=tuple(pool.spec.engine.extra_args),
    )


def vllm_containers(
    pool: InferencePool, role: Role, spec: RoleSpec, ctx: BuildContext, volumes: WorkerVolumes
) -> list[dict[str, Any]]:
    """`[engine, agent]`: the engine first, so it is the pod's default for `kubectl logs`."""
    cfg = serve_config(pool, role, spec)
    return [_engine(pool, spec, cfg, volumes), _agent(pool, ctx, cfg, volumes)]


def engine_env(pool: InferencePool, spec: RoleSpec, cfg: ServeConfig) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "USER", "value": ENGINE_USER},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
    ]
    if cfg.is_disaggregated:
        pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
        env.append({"name": SIDE_CHANNEL_HOST_ENV, "valueFrom": pod_ip})
    env += [{"name": k, "value": v} for k, v in serve_env(cfg).items()]
    env += ucx_env(pool, spec)
    return merge_env(env, [e.model_dump(mode="json") for e in spec.env])


def agent_env(pool: InferencePool, ctx: BuildContext, cfg: ServeConfig) -> list[dict[str, Any]]:
    """The pool's identity, etcd and NATS, the model, and which vLLM server it stands for."""
    env = [*identity_env(pool), *infrastructure(pool, ctx)[0], *model_env(pool)]
    return merge_env(
        env,
        [
            setting("served_model_name", cfg.served_model_name),
            setting("role", cfg.role),
            setting("vllm_url", vllm_url()),
        ],
    )


def engine_probes() -> dict[str, Any]:
    """vLLM's `/health`: ready and live once the engine answers; a long startup allowance."""
    return {
        "readinessProbe": http_probe("/health", "http", 5, 3),
        "livenessProbe": http_probe("/health", "http", 10, 6),
        "startupProbe": http_probe("/health", "http", STARTUP_PROBE_PERIOD_S,
                                   STARTUP_PROBE_FAILURES),
    }  # fmt: skip


def _engine(
    pool: InferencePool, spec: RoleSpec, cfg: ServeConfig, volumes: WorkerVolumes
) -> dict[str, Any]:
    ports = [{"name": "http", "containerPort": VLLM_PORT, "protocol": "TCP"}]
    if cfg.is_disaggregated:
        ports.append({"name": "nixl", "containerPort": NIXL_SIDE_CHANNEL_PORT, "protocol": "TCP"})
    return {
        "name": ENGINE_CONTAINER,
        "image": vllm_image(pool),
        "imagePullPolicy": pool.spec.image_pull_policy,
        "command": serve_argv(cfg),
        "ports": ports,
        "env": engine_env(pool, spec, cfg),
        "resources": placement.resources(pool, spec),
        "securityContext": container_security_context(placement.capabilities(pool)),
        "volumeMounts": [*volumes.scratch_mounts, *volumes.model_mounts],
        **engine_probes(),
    }


def _agent(
    pool: InferencePool, ctx: BuildContext, cfg: ServeConfig, volumes: WorkerVolumes
) -> dict[str, Any]:
    tmp = [dict(m) for m in volumes.scratch_mounts if m["mountPath"] == "/tmp"]
    return {
        "name": AGENT_CONTAINER,
        "image": image(pool, ctx),
        "imagePullPolicy": pool.spec.image_pull_policy,
        "command": list(AGENT_COMMAND),
        "env": agent_env(pool, ctx, cfg),
        "resources": {k: dict(v) for k, v in AGENT_RESOURCES.items()},
        "securityContext": container_security_context([]),
        "volumeMounts": [*tmp, *volumes.secret_mounts],
    }
