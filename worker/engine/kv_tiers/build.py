"""The lower tiers an engine's config asks for, built and attached to its scheduler."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrail.errors import ConfigError
from kvrail.fingerprint import ModelFingerprint
from kvrail.worker.engine.config import EngineConfig
from kvrail.worker.engine.kv_tiers.disk import HEADER_BYTES
from kvrail.worker.engine.kv_tiers.tiers import KvTiers
from kvrail.worker.kv_cache import KVCache

if TYPE_CHECKING:
    from kvrail.worker.engine.scheduler import Scheduler


def layout_key(fingerprint: ModelFingerprint) -> bytes:
    """The 32-byte key disk files carry: the model fingerprint's digest (weights, KV layout and
    dtype, block size), so no file is ever read by an engine of another."""
    return bytes.fromhex(fingerprint.digest)


def build_tiers(
    config: EngineConfig,
    kv_cache: KVCache,
    scheduler: Scheduler,
    fingerprint: ModelFingerprint,
    peers: object | None,
) -> KvTiers | None:
    """None without a host tier; raises ConfigError for tiers this engine cannot keep."""
    if not config.kv_host_tier_bytes:
        return None
    if peers is not None:
        raise ConfigError("KV tiers run on one rank for now: tensor_parallel_size must be 1")
    if config.kv_host_tier_bytes < kv_cache.block_bytes:
        raise ConfigError(f"kv_host_tier_bytes {config.kv_host_tier_bytes} holds no KV block "
                          f"({kv_cache.block_bytes} bytes)")  # fmt: skip
    disk_block_bytes = HEADER_BYTES + kv_cache.block_bytes
    if config.kv_disk_tier_path and config.kv_disk_tier_bytes < disk_block_bytes:
        raise ConfigError(f"kv_disk_tier_bytes {config.kv_disk_tier_bytes} holds no KV block "
                          f"({disk_block_bytes} bytes with its header)")  # fmt: skip
    manager = scheduler.kv_cache_manager
    tiers = KvTiers(
        kv_cache, config.kv_host_tier_bytes, pin=manager.pin, unpin=manager.unpin,
        layout=layout_key(fingerprint), disk_path=config.kv_disk_tier_path,
        disk_bytes=config.kv_disk_tier_bytes, zero_on_release=config.zero_kv_on_release,
    )  # fmt: skip
    scheduler.attach_tiers(tiers)
    return tiers
