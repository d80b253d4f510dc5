"""The handoff envelope: what the decode worker checks before a sequence may run.

Wrong text with HTTP 200 after a bad or stale transfer is the failure users of other systems
report most; here nothing becomes runnable until the completion matches the reservation exactly:
the request, the fingerprint, the decode worker's incarnation, the very blocks reserved, the
prompt length, and (when asked for; always in tests) a checksum of every block's bytes, of
every shard when the workers are tensor-parallel (`Connector.block_checksums`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrail.errors import TransferError
from kvrail.messages import PrefillDone
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.transfer import layer_groups
from kvrail.worker.transfer.connector import Connector


class EnvelopeError(TransferError):
    """A completion did not match its reservation; `reason` is a metric-safe code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Reservation:
    """What the decode worker reserved for one remote prefill."""

    request_id: str
    fingerprint: str
    incarnation: int
    block_ids: tuple[int, ...]
    num_prompt_tokens: int
    deadline_unix_s: float


def block_checksums(region: KVCache, block_ids: Sequence[int]) -> tuple[str, ...]:
    """8-byte BLAKE2b of each block's bytes, in order (copied to host memory for a GPU region)."""
    out = []
    for block_id in block_ids:
        raw = region.block_bytes_view(block_id)
        data = raw.cpu().numpy() if raw.is_cuda else raw.numpy()
        out.append(hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest())
    return tuple(out)


def checksums_of(
    done: PrefillDone, connector: Connector
) -> Callable[[Sequence[int]], Sequence[str]]:
    """What `validate` compares `done.block_checksums` with: every block's checksums, or for a
    layer-wise write each layer group's (refused as `layer_groups` unless the groups cover this
    model's layers, in order)."""
    groups = done.layer_groups
    if not groups:
        return connector.block_checksums

    def per_group(block_ids: Sequence[int]) -> Sequence[str]:
        try:
            layer_groups.check_groups(groups, connector.region.num_layers)
        except TransferError as err:
            raise EnvelopeError("layer_groups", str(err)) from err
        return [
            checksum
            for g in range(len(groups))
            for checksum in connector.layer_checksums(
                block_ids, layer_groups.group_layers(groups, g)
            )
        ]

    return per_group


def validate(
    done: PrefillDone,
    reservation: Reservation,
    now_unix_s: float,
    checksums: Callable[[Sequence[int]], Sequence[str]] | None = None,
) -> None:
    """Raise EnvelopeError unless `done` completes `reservation`. Pass `checksums` (the
    checksums of blocks as they are here now, every shard, e.g. `Connector.block_checksums`) to
    verify the ones the prefill worker sent against the bytes that landed; a completion without
    a checksum for every block and shard is refused then. For a layer-wise write
    (`done.layer_groups`) pass the checksums per group of those groups instead
    (`Connector.layer_checksums`), checked to cover the model's layers first."""
    r = reservation
    if done.request_id != r.request_id:
        raise EnvelopeError("wrong_request", "completion is for another request")
    if done.error is not None:
        raise EnvelopeError("prefill_failed", "the prefill worker reported a failure")
    if now_unix_s > r.deadline_unix_s:
        raise EnvelopeError("deadline", "completion arrived after the request's deadline")
    if done.fingerprint != r.fingerprint:
        raise EnvelopeError("fingerprint", "prefill worker runs a different model layout")
    if done.dest_incarnation != r.incarnation:
        raise EnvelopeError("stale_incarnation", "completion addressed to an older incarnation")
    if done.block_ids != r.block_ids:
        raise EnvelopeError("blocks", "written blocks differ from the reserved blocks")
    if done.num_prompt_tokens != r.num_prompt_tokens:
        raise EnvelopeError("tokens", "prefill covered a different number of prompt tokens")
    if checksums is None:
        return
    landed = tuple(checksums(r.block_ids))
    if len(done.block_checksums) != len(landed):
        raise EnvelopeError("checksum", "completion carries no checksum for every block")
    if done.layer_groups:  # layer-wise: name the groups (and ranks) that differ
        num_groups, num_blocks = len(done.layer_groups), len(r.block_ids)
        parts = layer_groups.bad_groups(done.block_checksums, landed, num_groups, num_blocks)
        if parts:
            detail = f"layer groups {sorted({g for g, _ in parts})} differ"
            num_shards = len(landed) // (num_groups * num_blocks)
            if num_shards > 1:
                detail += f" (ranks {sorted({s for _, s in parts})} of {num_shards})"
            raise EnvelopeError("checksum", detail)
        return
    bad = sum(want != got for want, got in zip(done.block_checksums, landed, strict=True))
    if bad:
        raise EnvelopeError("checksum", f"{bad} of {len(landed)} blocks differ")
