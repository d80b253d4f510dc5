"""The engine: scheduler + model runner + sampler behind add_request / step / abort.

One `step()` schedules a batch, runs the model once over it and samples one token for every
request whose known tokens are now all computed. The engine is single-threaded; the worker roles
drive it. Finished requests leave the engine holding no blocks.

With `async_scheduling` (the default on CUDA) a step is queued on the device before the previous
one has finished (`step_pipeline.StepPipeline` says how, and what it guarantees); while `step`
waits for a step's tokens it calls `pipeline.step_waiter`, during which `EngineService` runs its
commands, so a reservation or an install does not wait for the step to end.

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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvrail.errors import ConfigError, InvalidRequestError
from kvrail.fingerprint import ModelFingerprint
from kvrail.hashing import root_hash
from kvrail.messages import KvTier
from kvrail.model_files import ModelSource
from kvrail.outputs import RequestOutput, TokenLogprobs
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.engine.config import EngineConfig, dtype_name, kv_cache_dtype
from kvrail.worker.engine.cuda_graph import StepGraphs
from kvrail.worker.engine.fence import DeviceFence
from kvrail.worker.engine.fingerprint import make_fingerprint
from kvrail.worker.engine.grammar import Grammars, fill_threads
from kvrail.worker.engine.grammar_masks import MaskFiller
from kvrail.worker.engine.kv_tiers.build import build_tiers
from kvrail.worker.engine.kv_tiers.stats import TierStats
from kvrail.worker.engine.model_runner import ModelRunner
from kvrail.worker.engine.rank_commands import CaptureGraphs, RankPeers, ZeroBlocks
from kvrail.worker.engine.request import Request, request_output
from kvrail.worker.engine.sampler import Sampler
from kvrail.worker.engine.scheduler import Scheduler
from kvrail.worker.engine.scheduler_output import RemoteReservation
from kvrail.worker.engine.staging import to_device
from kvrail.worker.engine.step_pipeline import StepPipeline
from kvrail.worker.engine.stop import StopChecker
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.models.llama import LlamaForCausalLM
from kvrail.worker.models.loader import LoadedModel
from kvrail.worker.models.quant import check_device, resolve_quantization
from kvrail.worker.parallel.group import TpGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Counts:
    """Blocks (null block excluded) and requests the engine holds right now."""

    num_blocks: int
    num_free_blocks: int
    num_requests: int
    num_retained: int
    num_running: int
    num_waiting: int
    tiers: TierStats
    """The lower KV tiers' use (empty without tiers)."""


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
        self.grammars = Grammars.from_hf(
            tokenizer, eos_token_id, shape.vocab_size, fill_threads(config.grammar_threads)
        )
        self.scheduler = Scheduler(
            config, root_hash(fingerprint.digest), StopChecker(eos_token_id),
            self._zero_blocks if config.zero_kv_on_release else None, self.grammars,
        )  # fmt: skip
        self.tiers = build_tiers(config, self.kv_cache, self.scheduler, fingerprint, peers)
        self._tenant_roots: dict[str, bytes] = {}
        graphs = None
        if self.device.type == "cuda" and config.enable_cuda_graphs:
            max_blocks = -(-config.max_model_len // config.block_size)
            mixed = min(config.max_mixed_graph_tokens, config.max_num_batched_tokens)
            capture = CaptureGraphs(
                config.max_num_seqs, max_blocks, mixed, config.shared_prefix_decode
            )
            graphs = StepGraphs(model, self.kv_cache, *capture.sizes)
            if peers is not None:  # the graphs hold collectives: every rank captures together
                peers.send(capture)
            graphs.capture()
        self.runner = runner = ModelRunner(
            model, self.kv_cache, self.device, graphs, peers, config.shared_prefix_decode
        )
        async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.device.type == "cuda"
        )
        masks = MaskFiller(self.grammars, self.device, config.grammar_threads)
        self.pipeline = StepPipeline(
            self.scheduler, runner, Sampler(eos_token_id), async_scheduling, masks
        )
        self._num_generate_calls = 0
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
        if any(b.token_id >= vocab for b in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be below {vocab}", "logit_bias")
        params.check_prompt_scores(len(prompt_token_ids))

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

    def install_remote(
        self,
        request_id: str,
        first_token_id: int,
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: Sequence[TokenLogprobs] = (),
    ) -> RequestOutput:
        """Make a reserved request runnable: its prompt KV landed (and was validated) and
        `first_token_id` was sampled from it elsewhere, with `logprobs` and the prompt's scores
        (`prompt_logprobs`) if the request asked. Returns the request's first output, as a step
        would have made it (it may already be finished). Raises KeyError when the request is
        not waiting for remote KV."""
        request = self.scheduler.requests.get(request_id)
        if request is not None and prompt_logprobs:
            request.prompt_logprobs.extend(prompt_logprobs)
            request.num_prompt_scored = len(prompt_logprobs)
        return request_output(self.scheduler.install_remote(request_id, first_token_id), logprobs)

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

    def take_tier_events(self) -> list[KvChanges]:
        """The lower tiers' net changes since the last call, one `KvChanges` per tier that
        changed (`tier` "host" or "disk"), fastest tier first. A stored hash's block is resident
        and checksummed in that tier; a block may be in several tiers at once (the GPU's
        included: `take_kv_events`)."""
        return self.tiers.take_changes() if self.tiers is not None else []

    def tier_block_hashes(self, tier: KvTier) -> list[bytes]:
        """Every block hash a tier holds now (`cached_block_hashes` for "gpu")."""
        if tier == "gpu":
            return self.cached_block_hashes()
        return self.tiers.hashes(tier) if self.tiers is not None else []

    def tier_stats(self) -> TierStats:
        """Capacity and use of each lower tier (empty without tiers)."""
        return self.tiers.stats() if self.tiers is not None else TierStats()

    def close(self) -> None:
        """Finish what the tiers queued for the disk (the engine is not used after this)."""
        if self.tiers is not None:
            self.tiers.close()

    def _zero_blocks(self, block_ids: list[int]) -> None:
        """Zero released blocks (every layer, K and V). On a GPU the fill is queued on the
        stream, after every kernel that used the blocks and before any later write."""
        if self.tiers is not None:
            self.tiers.released(block_ids)  # their copies in host memory and on disk go too
        ids = np.asarray(block_ids, dtype=np.int64)
        if self.peers is not None:
            self.peers.send(ZeroBlocks(ids))
        self.kv_cache.zero_blocks(to_device(ids, self.device))

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: requests, or the KV tiers' copies to finish."""
        return bool(self.scheduler.requests) or (self.tiers is not None and self.tiers.busy)

    def counts(self) -> Counts:
        """What the KV pool and the scheduler hold right now."""
        scheduler = self.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        _used, cached, free = pool.counts()
        return Counts(
            num_blocks=pool.num_blocks - 1,
            num_free_blocks=cached + free,
            num_requests=len(scheduler.requests),
            num_retained=len(scheduler.retained),
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            tiers=self.tier_stats(),
        )

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that got a token. With
        `async_scheduling` it leaves the next step queued on the device."""
        advanced, logprobs = self.pipeline.step()
        if not logprobs:
            return [request_output(r) for r in advanced]
        return [request_output(r, logprobs.get(r.request_id)) for r in advanced]

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
