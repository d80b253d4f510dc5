"""How many layer groups a prefill worker writes each job's KV in (docs/layerwise.md): the
setting's count for every job, or with `kv_transfer_layer_groups: auto` a count per job from
`layer_groups.choose_num_groups`, fed by what this worker measured: each peer link's bandwidth
and per-block cost while a prefill runs (`link_speed.PeerLinks`) and its prefills' seconds per
computed token.

A job's transfer is its blocks' bytes (every shard's: `Connector.block_bytes`); its prefill is
its tokens after the decode worker's cached prefix, at the measured seconds per token (the
engine's queue included: the time until the prompt's last layer as this worker sees it; a
prefix cached here makes the prefill shorter than that, and the groups then more than needed,
each a set-up more). A prompt longer than one engine step (`max_num_batched_tokens`) is
prefilled in chunks and only its last step's blocks go in groups (those of earlier chunks go
whole while the next chunk computes): both the prefill and the bytes are taken for that step's
share. Before this worker measured any prefill, a job goes whole, which measures both.

Over CUDA IPC a job always goes whole. Its groups' copies are gather/scatter kernels on the
prefill's GPU, which take SMs from the prefill while they overlap it, and the whole write they
would hide is short (1-3 ms for 8k-32k tokens of a Llama-3-8B on an H100). On the lent H100
(bench/transfer/layerwise_h100_2026-12-07c.txt) every count lost against a whole write: 2 groups
12 ms at 8k tokens and 17 ms at 32k, the counts this rule chose before (22-32) 4 and 15 ms.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvrail.errors import ConfigError, TransferError
from kvrail.messages import PrefillJob
from kvrail.worker.transfer.connector import Connector
from kvrail.worker.transfer.layer_groups import (
    LayerGroups,
    WriteCost,
    choose_num_groups,
    plan_groups,
)
from kvrail.worker.transfer.link_speed import IDLE_BLOCK_S, DecayedRatio, PeerLinks, WriteTiming

log = logging.getLogger(__name__)

GROUP_SETUP_S = 0.5e-3
"""One write's set-up (its transfer's posting), as `choose_num_groups` charges it, an
assumption. Each block costs more (`link_speed.PeerLinks`, `WriteCost`)."""


class GroupChoice:
    """See the module docstring. Called from the event loop's thread only."""

    def __init__(
        self, setting: int | str, connector: Connector, block_size: int, step_tokens: int
    ) -> None:
        if setting and not connector.supports_layers:
            raise ConfigError("kv_transfer_layer_groups: this worker's KV connector cannot")
        self.is_auto = setting == "auto"
        self.num_layers = 0  # the connector is read only when groups are asked for
        self._fixed: LayerGroups = ()
        if setting:
            self.num_layers = connector.region.num_layers
            if not self.is_auto:
                self._fixed = plan_groups(self.num_layers, int(setting))
        self._connector = connector
        self._block_size = block_size
        self._step_tokens = step_tokens
        self.links = PeerLinks()
        self.prefill = DecayedRatio()  # seconds per computed token

    def plan(self, job: PrefillJob) -> LayerGroups:
        """The groups of this job's write; () for one whole write."""
        if not self.is_auto:
            return self._fixed
        peer = job.dest_agent_name
        try:
            transport = self._connector.transport_to(peer)
        except TransferError:  # not loaded yet: the write will say so
            transport = self._connector.transport
        if transport == "cuda-ipc":  # its copy is a kernel on the prefill's own GPU
            return ()
        per_token_s = self.prefill.value
        if per_token_s is None:  # nothing measured yet: a whole write measures both
            return ()
        num_tokens = len(job.token_ids) - job.first_block_index * self._block_size
        share = min(1.0, self._step_tokens / num_tokens) if num_tokens > 0 else 1.0
        kv_bytes = int(len(job.dest_block_ids) * self._connector.block_bytes * share)
        prefill_s = num_tokens * share * per_token_s
        link = self.links.estimate(peer, transport)
        cost = WriteCost(GROUP_SETUP_S, link.busy_block_s, IDLE_BLOCK_S)
        num_blocks = round(len(job.dest_block_ids) * share)
        num_groups = choose_num_groups(
            kv_bytes, link.bytes_per_s, prefill_s, num_blocks, cost, self.num_layers
        )
        log.debug(
            "layer groups chosen request_id=%s groups=%d kv_bytes=%d link_bytes_per_s=%.4g "
            "measured=%s busy_block_s=%.3g prefill_s=%.4f",
            job.request_id, num_groups, kv_bytes, link.bytes_per_s, link.measured,
            cost.busy_block_s, prefill_s,
        )  # fmt: skip
        return plan_groups(self.num_layers, num_groups)

    def computed(self, num_tokens: int, seconds: float) -> None:
        """A prefill of `num_tokens` computed tokens took `seconds` (from handing it to the
        engine to its first token)."""
        self.prefill.add(seconds, num_tokens)

    def wrote(self, peer: str, writes: Sequence[WriteTiming]) -> None:
        """A job's writes to `peer` completed: one whole write, or each of a layer-wise one's."""
        self.links.observe(peer, writes)
