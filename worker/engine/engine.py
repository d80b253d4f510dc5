"""The engine: scheduler + model runner + sampler behind add_request / step / abort.

One `step()` schedules a batch, runs the model once over it and samples one token for every
request whose known tokens are now all computed. The engine is single-threaded; the worker roles
drive it. Finished requests leave the engine holding no blocks.

With `async_scheduling` (the default on CUDA) a step is queued on the device before the previous
one has finished: `step()` schedules the next step ahead (`Scheduler.schedule_ahead`) and queues
it, then waits for the running step's tokens and returns that step's outputs. The host's work for
a step (scheduling, input preparation, the graph launch, stop checks) thus overlaps the device's.
Each `step()` still returns one step's outputs, and every request gets the tokens it would get
without it; only the batches can differ (scheduling ahead cannot yet see which requests finish
or free blocks in the running step). At most one step is in flight between calls. Its writes
land in the blocks of the requests it was queued for, which stay valid on the device even if the
host frees them meanwhile (device work is ordered); the one writer outside that order, a remote
KV transfer, gets blocks only through `reserve_remote`, whose reservation carries a fence behind
the step in flight (`DeviceFence`): the writer starts only once it has passed. While `step`
waits for a step's tokens it calls `step_waiter`; `EngineService` runs its commands then, so a
reservation or an install does not wait for the step to end.

Tensor parallelism: the model is rank 0's shard and `peers` are the worker's other ranks
(`RankPeers`, driven by rank 0). The scheduler, the block manager and the sampler stay here, once;
each step's inputs go to every rank, which runs the same step on the same block tables over its
own KV shard (`kv_cache` here is rank 0's), and the sampled tokens come back to every rank by a
broadcast queued right after sampling, so async scheduling and CUDA graphs work as without it.
A rank lost mid-step makes `step()` raise (`RankLostError`, or the collective's own error); the
engine is unusable after that and the worker fails as a whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvrail.errors import ConfigError, InvalidRequestError
from kvrail.fingerprint import ModelFingerprint
from kvrail.hashing import root_hash
from kvrail.model_files import ModelSource
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.engine.config import EngineConfig, dtype_name, kv_cache_dtype
from kvrail.worker.engine.cuda_graph import StepGraphs
from kvrail.worker.engine.fence import DeviceFence
from kvrail.worker.engine.model_runner import ModelRunner, SampledOnDevice
from kvrail.worker.engine.rank_commands import CaptureGraphs, RankPeers, ZeroBlocks
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.sampler import Sampler
from kvrail.worker.engine.scheduler import Scheduler
from kvrail.worker.engine.scheduler_output import RemoteReservation, SchedulerOutput
from kvrail.worker.engine.staging import to_device
from kvrail.worker.engine.stop import StopChecker
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.models.llama import LlamaForCausalLM
from kvrail.worker.models.loader import LoadedModel
from kvrail.worker.models.quant import check_device, resolve_quantization
from kvrail.worker.parallel.group import TpGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step did to a request: the tokens it sampled for it (only those: a request's
    whole output is the concatenation over its outputs), and why it finished, if it did."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    stop_reason: int | None
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (vLLM's `cached_tokens`)."""


@dataclass(slots=True)
class _Launched:
    """A step queued on the device: what was scheduled, the requests its rows sample for, and
    its tokens (on the device, and in host memory once `done` has passed)."""

    out: SchedulerOutput
    requests: list[Request]
    sampled: SampledOnDevice
    host_tokens: torch.Tensor
    done: torch.cuda.Event | None


StepWaiter = Callable[[torch.cuda.Event | None], None]
"""How `step` waits for a launched step's tokens: called with the step's CUDA event (None on
the CPU, where the step has already run), it returns once the event has passed. Whatever it
does meanwhile runs with the step (and, with async scheduling, the step after it) queued on
the device and that step's outputs not yet applied, the state any caller between two `step`s
sees, but with one more step in flight: a request aborted now is skipped when the step's
outputs are applied, and a `reserve_remote` fence records behind both steps."""


def synchronize(done: torch.cuda.Event | None) -> None:
    """The default `StepWaiter`: block until the step's tokens are on the host."""
    if done is not None:
        done.synchronize()


def make_fingerprint(
    model: LlamaForCausalLM, config: EngineConfig, weights_id: str, tokenizer_id: str
) -> ModelFingerprint:
    shape = model.shape
    param = next(model.parameters())
    return ModelFingerprint(
        tensor_parallel_size=model.group.size,
        weights_id=weights_id,
        tokenizer_id=tokenizer_id,
        dtype=dtype_name(param.dtype),
        kv_dtype=dtype_name(kv_cache_dtype(config.kv_dtype, param.dtype, param.device.type)),
        quantization=model.quantization,
        block_size=config.block_size,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rope_theta=shape.rope_theta,
        rope_scaling=tuple((k, str(v)) for k, v in shape.rope_scaling),
    )


class LLMEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig,
        fingerprint: ModelFingerprint,
        tokenizer: Any = None,
        eos_token_id: int | None = None,
        peers: RankPeers | None = None,
    ) -> None:
        param = next(model.parameters())
        if fingerprint.tensor_parallel_size != model.group.size:
            raise ConfigError(
                f"fingerprint tensor_parallel_size={fingerprint.tensor_parallel_size} but the "
                f"model runs on {model.group.size} ranks"
            )
        if (peers.size if peers is not None else 1) != model.group.size:
            raise ConfigError("a tensor-parallel engine needs exactly its group's other ranks")
        kv_dtype = kv_cache_dtype(config.kv_dtype, param.dtype, param.device.type)
        if fingerprint.kv_dtype != dtype_name(kv_dtype):
            raise ConfigError(
                f"fingerprint kv_dtype={fingerprint.kv_dtype} but the engine caches KV in "
                f"{dtype_name(kv_dtype)}"
            )
        self.peers = peers
        self.device = param.device
        self.model = model.eval()
        shape = model.shape
        if config.max_model_len > shape.max_position:
            raise ConfigError(
                f"max_model_len {config.max_model_len} exceeds the model's {shape.max_position}"
            )
        if not config.max_model_len:
            config = replace(config, max_model_len=shape.max_position)
        self.config = config
        self.fingerprint = fingerprint
        self.tokenizer = tokenizer
        self.kv_cache = KVCache.allocate(
            config.num_blocks,
            shape.num_layers,
            config.block_size,
            model.layout.num_local_kv_heads,
            shape.head_dim,
            kv_dtype,
            self.device,
        )
        self.scheduler = Scheduler(
            config, root_hash(fingerprint.digest), StopChecker(eos_token_id),
            self._zero_blocks if config.zero_kv_on_release else None,
        )  # fmt: skip
        self._tenant_roots: dict[str, bytes] = {}
        graphs = None
        if self.device.type == "cuda" and config.enable_cuda_graphs:
            max_blocks = -(-config.max_model_len // config.block_size)
            mixed = min(config.max_mixed_graph_tokens, config.max_num_batched_tokens)
            capture = CaptureGraphs(config.max_num_seqs, max_blocks, mixed)
            graphs = StepGraphs(model, self.kv_cache, *capture.sizes)
            if peers is not None:  # the graphs hold collectives: every rank captures together
                peers.send(capture)
            graphs.capture()
        self.runner = ModelRunner(model, self.kv_cache, self.device, graphs, peers)
        self.sampler = Sampler(eos_token_id)
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.device.type == "cuda"
        )
        self._in_flight: _Launched | None = None
        self._num_generate_calls = 0
        self.step_waiter: StepWaiter = synchronize
        """Replaced by `EngineService`, which runs its commands while a step runs."""
        logger.info(
            "engine ready fingerprint=%s blocks=%d kv_bytes=%d device=%s tensor_parallel=%d",
            fingerprint.short,
            config.num_blocks,
            self.kv_cache.nbytes,
            self.device,
            model.group.size,
        )

    @property
    def max_request_tokens(self) -> int:
        """The longest prompt + completion this engine can ever hold: the model length, or what
        the KV pool holds (the null block left out) when that is less. What the worker announces,
        so a router never sends a request the engine must refuse."""
        pool = (self.config.num_blocks - 1) * self.config.block_size
        return min(self.config.max_model_len, pool)

    @classmethod
    def from_source(
        cls,
        source: ModelSource | str,
        config: EngineConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        quantization: str = "auto",
    ) -> LLMEngine:
        """Load a model source (cached conversion) and build an engine."""
        from kvrail.worker.models.loader import load

        return cls.from_loaded(
            load(source), config, dtype=dtype, device=device, quantization=quantization
        )

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        config: EngineConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        group: TpGroup | None = None,
        peers: RankPeers | None = None,
        quantization: str = "auto",
    ) -> LLMEngine:
        """An engine over already loaded weights and tokenizer (see `from_source`). The
        fingerprint's weights and tokenizer ids are the source's weights id (a GGUF file carries
        its tokenizer). With tensor parallelism: rank 0's `group` and the other ranks, `peers`
        (`kvrail.worker.ranks` starts them), and the model holds rank 0's shard. Without a
        tokenizer, the end-of-sequence token is the model config's. `quantization`: see
        `kvrail.worker.models.quant`."""
        quantization = resolve_quantization(quantization, loaded.config)
        check_device(quantization, torch.device(device).type, dtype)
        model = LlamaForCausalLM.build(
            loaded.config, loaded.state_dict, dtype=dtype, device=device,
            quantization=quantization, group=group,
        )  # fmt: skip
        fingerprint = make_fingerprint(model, config, loaded.weights_id, loaded.weights_id)
        tokenizer = loaded.tokenizer
        eos = getattr(tokenizer if tokenizer is not None else loaded.config, "eos_token_id", None)
        if isinstance(eos, list):  # a config may list several; the tokenizer's is the first
            eos = eos[0] if eos else None
        return cls(model, config, fingerprint, tokenizer, eos, peers)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        retain_blocks: bool = False,
        tenant_salt: str = "",
    ) -> Request:
        """Queue a request; raises InvalidRequestError (and keeps nothing) when it is invalid.
        With `retain_blocks` its KV blocks outlive it until `release` (the prefill role). A
        `tenant_salt` seeds its block hashes, so tenants never share cached prefixes."""
        self._check_token_ids(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, retain_blocks=retain_blocks)
        request.hash_root = self._hash_root(tenant_salt)
        self.scheduler.add_request(request)
        return request

    def _check_token_ids(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Refuse ids the model does not have before they reach a step: an out-of-range id
        would fail the whole batch, every other request with it."""
        vocab = self.model.shape.vocab_size
        if any(t >= vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be below {vocab}", "prompt")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below {vocab}", "stop_token_ids")

    def reserve_remote(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        tenant_salt: str = "",
    ) -> RemoteReservation | None:
        """Reserve blocks for a request whose prompt KV is written from elsewhere (see
        Scheduler.reserve_remote); None with no effect when the pool is short. A block it gets
        may have been freed while the step in flight still writes it, and the remote writer is
        not ordered after device work: the reservation's `fence` passes once that step (and
        everything else queued so far) has finished. Nothing waits for it here."""
        self._check_token_ids(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params)
        request.hash_root = self._hash_root(tenant_salt)
        reservation = self.scheduler.reserve_remote(request)
        if reservation is None:
            return None
        return replace(reservation, fence=DeviceFence.now(self.device))

    def install_remote(self, request_id: str, first_token_id: int) -> None:
        self.scheduler.install_remote(request_id, first_token_id)

    def _hash_root(self, tenant_salt: str) -> bytes | None:
        if not tenant_salt:
            return None
        root = self._tenant_roots.get(tenant_salt)
        if root is None:
            root = self._tenant_roots[tenant_salt] = root_hash(self.fingerprint.digest, tenant_salt)
        return root

    def retained_block_ids(self, request_id: str) -> list[int]:
        """Block ids of a finished request that retains its blocks (its KV, in table order)."""
        if request_id not in self.scheduler.retained:
            raise KeyError(f"request {request_id!r} holds no retained blocks")
        return self.scheduler.kv_cache_manager.get_block_ids(request_id)

    def release(self, request_id: str) -> None:
        """Free a finished request's retained blocks (after they were sent)."""
        self.scheduler.release(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state, freeing all its blocks. False if unknown."""
        return self.scheduler.abort(request_id)

    def take_kv_events(self) -> KvChanges:
        """Block hashes that entered or left the prefix cache since the last call, net (see
        `KvChanges`). A stored hash's KV is fully written: a later request with that prefix hits
        it here. Remotely installed prompts count too (they enter the cache at install)."""
        return self.scheduler.kv_cache_manager.take_kv_changes()

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash in the prefix cache now (those of running requests included)."""
        return self.scheduler.kv_cache_manager.cached_block_hashes()

    def _zero_blocks(self, block_ids: list[int]) -> None:
        """Zero released blocks (every layer, K and V). On a GPU the fill is queued on the
        stream, after every kernel that used the blocks and before any later write."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if self.peers is not None:
            self.peers.send(ZeroBlocks(ids))
        self.kv_cache.zero_blocks(to_device(ids, self.device))

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that got a token. With
        `async_scheduling` it leaves the next step queued on the device."""
        try:
            return self._step()
        except BaseException:
            self._in_flight = None  # its requests are failed by the caller
            raise

    def _step(self) -> list[RequestOutput]:
        running = self._in_flight
        self._in_flight = None
        if running is None:
            running = self._launch(self.scheduler.schedule())
            if running is None:
                return []
        if not self.async_scheduling:
            return self._resolve(running)
        ahead = self.scheduler.schedule_ahead()
        if ahead is None:  # it would preempt: only with the running step's tokens known
            outputs = self._resolve(running)
            self._in_flight = self._launch(self.scheduler.schedule())
            return outputs
        self._in_flight = self._launch(ahead, running.sampled)
        return self._resolve(running)

    def _launch(
        self, out: SchedulerOutput, previous: SampledOnDevice | None = None
    ) -> _Launched | None:
        """Queue a scheduled step on the device (on the CPU it runs now); None if it is empty."""
        if out.is_empty:
            return None
        logits, requests = self.runner.execute(out, previous)
        tokens = (
            self.sampler.sample(logits, requests)
            if requests
            else logits.new_empty(0, dtype=torch.int64)
        )
        tokens = self.runner.share_tokens(tokens)  # every rank feeds them to the next step
        sampled = SampledOnDevice(tokens, {r.request_id: i for i, r in enumerate(requests)})
        if self.device.type != "cuda":
            return _Launched(out, requests, sampled, tokens, None)
        host = torch.empty(tokens.shape, dtype=torch.int64, device="cpu", pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _Launched(out, requests, sampled, host, done)

    def _resolve(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them to its requests."""
        self.step_waiter(launched.done)
        token_ids = launched.host_tokens.tolist()
        sampled = {r.request_id: t for r, t in zip(launched.requests, token_ids, strict=True)}
        advanced = self.scheduler.update_from_output(launched.out, sampled)
        return [
            RequestOutput(
                r.request_id,
                (r.output_token_ids[-1],),
                r.is_finished,
                r.status.finish_reason,
                r.stop_reason,
                r.num_cached_tokens,
            )
            for r in advanced
        ]

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        call = self._num_generate_calls
        self._num_generate_calls += 1
        requests = [
            self.add_request(f"generate-{call}-{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, all_params, strict=True))
        ]
        while self.has_unfinished_requests():
            self.step()
        return [r.output_token_ids for r in requests]
