"""The lower KV tiers on a tiny random model: multi-turn sessions whose prefixes outgrow the GPU
pool are served from host memory and disk with the same tokens as without tiers; a corrupted block
is caught by its checksum and recomputed; tenants never share a tier's blocks; zeroKVOnRelease
leaves nothing in any tier; a disk tier's files survive a restart only when they check out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvrail.errors import ConfigError
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.engine import LLMEngine
from kvrail.worker.engine.kv_tiers.disk import HEADER_BYTES, SUFFIX
from kvrail.worker.engine.request import RequestStatus
from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4  # layers x (K, V) x 4 tokens x 2 KV heads x dim 8 x float32
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
])]  # fmt: skip
"""On a GPU the copies run on their own streams, with async scheduling and CUDA graphs."""


def _engine(device: str = "cpu", **overrides: Any) -> LLMEngine:
    overrides.setdefault("num_blocks", 16)  # 15 blocks = 60 tokens: one session at a time
    with torch.device(device):
        return make_engine(tiny_llama_config(), seed=3, max_model_len=60, **overrides)


def _run(engine: LLMEngine, request_id: str, prompt: list[int], tenant: str = "") -> Any:
    request = engine.add_request(request_id, prompt, PARAMS, tenant_salt=tenant)
    while engine.has_unfinished_requests():
        engine.step()
    return request


def _sessions(num_sessions: int = 3, turns: int = 3) -> list[tuple[str, list[int]]]:
    """Turns of sessions, round robin: each turn's prompt extends the session's last one."""
    prompts = [[5 + s, 6 + s, 7 + s] for s in range(num_sessions)]
    out = []
    for turn in range(turns):
        for s, prompt in enumerate(prompts):
            prompt.extend((11 * s + 7 * turn + i) % 90 + 3 for i in range(13))
            out.append((f"s{s}t{turn}", list(prompt)))
    return out


def _serve(engine: LLMEngine) -> tuple[list[list[int]], list[int]]:
    outputs, cached = [], []
    for request_id, prompt in _sessions():
        request = _run(engine, request_id, prompt)
        outputs.append(list(request.output_token_ids))
        cached.append(request.num_cached_tokens)
    assert_engine_empty(engine)
    return outputs, cached


@pytest.mark.parametrize("device", DEVICES)
def test_sessions_larger_than_the_gpu_pool_hit_the_host_tier_with_the_same_tokens(
    device: str,
) -> None:
    plain_outputs, plain_cached = _serve(_engine(device))
    tiers = _engine(device, kv_host_tier_bytes=200 * BLOCK_BYTES)
    outputs, cached = _serve(tiers)
    assert outputs == plain_outputs
    # Without tiers the other sessions evicted each session's prefix before its next turn.
    assert sum(plain_cached[3:]) < sum(cached[3:])
    assert all(c >= len(p) - 16 for c, (_, p) in zip(cached[3:], _sessions()[3:], strict=True))
    assert tiers.tiers is not None and tiers.tiers.host.num_resident > 0
    tiers.tiers.host.check_invariants()
    stats = tiers.counts().tiers  # what the worker record and `kvrail status` show
    assert 0 < stats.hit_blocks["host"] * 4 <= sum(cached)
    assert stats.loads["host"] > 0 and stats.blocks["host"] == tiers.tiers.host.num_resident


@pytest.mark.parametrize("device", DEVICES)
def test_a_corrupted_host_block_is_caught_by_its_checksum_and_recomputed(device: str) -> None:
    engine = _engine(device, kv_host_tier_bytes=200 * BLOCK_BYTES)
    prompt = list(range(3, 43))  # 10 blocks
    first = _run(engine, "first", prompt)
    _run(engine, "evict", list(range(50, 90)))  # another prompt fills the GPU pool
    tiers = engine.tiers
    assert tiers is not None
    block_hash = first.block_hashes[6]  # past the first blocks, which stay on the GPU
    entry = tiers.host.resident(block_hash)
    assert entry is not None
    tiers.copier.host[entry.slot, 17] ^= 0x40  # one flipped bit in host memory
    again = _run(engine, "again", prompt)
    assert again.output_token_ids == first.output_token_ids
    assert again.num_cached_tokens == 6 * 4  # the blocks before the corrupted one
    # The corrupted copy was dropped; the recomputed block was written behind in its place.
    replaced = tiers.host.resident(block_hash)
    assert replaced is not None and replaced is not entry
    _run(engine, "evict again", list(range(50, 90)))
    third = _run(engine, "third", prompt)
    assert third.num_cached_tokens == 36 and third.output_token_ids == first.output_token_ids
    assert_engine_empty(engine)


def test_tenants_never_share_a_lower_tier_block() -> None:
    engine = _engine(kv_host_tier_bytes=200 * BLOCK_BYTES)
    prompt = list(range(3, 43))
    _run(engine, "alpha", prompt, tenant="alpha")
    _run(engine, "evict", list(range(50, 90)))
    assert _run(engine, "beta", prompt, tenant="beta").num_cached_tokens == 0
    _run(engine, "evict2", list(range(50, 90)))
    assert _run(engine, "alpha2", prompt, tenant="alpha").num_cached_tokens > 0


def test_a_load_done_when_it_starts_joins_that_very_step() -> None:
    # On a CPU device a load from host memory has run by the time `start_load` returns.
    engine = _engine(kv_host_tier_bytes=200 * BLOCK_BYTES)
    prompt = list(range(3, 43))
    first = _run(engine, "first", prompt)
    _run(engine, "evict", list(range(50, 90)))
    again = engine.add_request("again", prompt, PARAMS)
    outputs = engine.step()  # admitted, loaded and prefilled from its first block not loaded
    assert [o.request_id for o in outputs] == ["again"]
    assert again.output_token_ids == first.output_token_ids[:1]
    assert again.num_cached_tokens == 36  # all but the last block, which holds the last token
    while engine.has_unfinished_requests():
        engine.step()
    assert again.output_token_ids == first.output_token_ids
    assert_engine_empty(engine)


@pytest.mark.parametrize("device", DEVICES)
def test_an_abort_while_loading_frees_every_block_once_the_load_is_done(
    device: str, tmp_path: Path
) -> None:
    prompt = list(range(3, 43))
    # A load from host memory can be done as it starts (on a CPU at once; on a GPU beside the
    # step in flight, joining the step being scheduled): load from disk, a read in a thread.
    with torch.device(device):
        first = _disk_engine(tmp_path)
        _run(first, "first", prompt)
        _flush(first)
        engine = _disk_engine(tmp_path)  # restarted: the prompt's blocks are on disk only
    engine.add_request("loading", prompt, PARAMS)
    engine.step()  # admitted: its blocks load
    request = engine.scheduler.requests["loading"]
    assert request.status is RequestStatus.WAITING_FOR_TIER_KV
    assert engine.abort("loading")
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_empty(engine)


def test_zero_kv_on_release_leaves_nothing_in_host_memory_or_on_disk(tmp_path: Path) -> None:
    engine = _engine(
        kv_host_tier_bytes=200 * BLOCK_BYTES, zero_kv_on_release=True,
        kv_disk_tier_path=str(tmp_path), kv_disk_tier_bytes=200 * (BLOCK_BYTES + HEADER_BYTES),
    )  # fmt: skip
    _run(engine, "a", list(range(3, 43)))
    tiers = engine.tiers
    assert tiers is not None
    tiers.close()  # every queued disk job done
    tiers.poll()
    assert tiers.host.num_resident == 0 and not tiers.hashes("disk")
    assert not list(tmp_path.glob(f"*{SUFFIX}"))
    assert int(tiers.copier.host.count_nonzero()) == 0
    assert_engine_empty(engine)


def _disk_engine(path: Path, seed: int = 3, **overrides: Any) -> LLMEngine:
    return make_engine(
        tiny_llama_config(), seed=seed, max_model_len=60, num_blocks=16,
        kv_host_tier_bytes=16 * BLOCK_BYTES, kv_disk_tier_path=str(path),
        kv_disk_tier_bytes=100 * (BLOCK_BYTES + HEADER_BYTES), **overrides,
    )  # fmt: skip


def _flush(engine: LLMEngine) -> None:
    assert engine.tiers is not None
    while engine.tiers.busy:
        engine.step()
    engine.close()


def test_the_disk_tier_serves_prefixes_after_a_restart(tmp_path: Path) -> None:
    prompt = list(range(3, 43))
    plain = _run(_engine(), "plain", prompt)
    first = _disk_engine(tmp_path)
    _run(first, "a", prompt)
    _flush(first)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) >= 9  # every full block, through host memory
    restarted = _disk_engine(tmp_path)
    again = _run(restarted, "b", prompt)
    assert again.num_cached_tokens == 36  # all but the block holding the last token
    assert again.output_token_ids == plain.output_token_ids
    assert_engine_empty(restarted)


def test_disk_files_that_do_not_check_out_are_dropped_at_start(tmp_path: Path) -> None:
    prompt = list(range(3, 43))
    first = _disk_engine(tmp_path)
    _run(first, "a", prompt)
    _flush(first)
    files = sorted(tmp_path.glob(f"*{SUFFIX}"))
    files[0].write_bytes(files[0].read_bytes()[:-1])  # torn
    (tmp_path / f"{'ab' * 16}.tmp").write_bytes(b"half")  # a write that never finished
    restarted = _disk_engine(tmp_path)
    assert restarted.tiers is not None and restarted.tiers.disk is not None
    assert len(restarted.tiers.disk) == len(files) - 1
    assert not list(tmp_path.glob("*.tmp"))
    other_model = _disk_engine(tmp_path, seed=4)  # another fingerprint: nothing of it is kept
    assert other_model.tiers is not None and not other_model.tiers.hashes("disk")
    assert not list(tmp_path.glob(f"*{SUFFIX}"))


def test_a_corrupted_disk_block_is_recomputed(tmp_path: Path) -> None:
    prompt = list(range(3, 43))
    plain = _run(_engine(), "plain", prompt)
    first = _disk_engine(tmp_path)
    a = _run(first, "a", prompt)
    _flush(first)
    victim = tmp_path / f"{a.block_hashes[4].hex()}{SUFFIX}"
    raw = bytearray(victim.read_bytes())
    raw[HEADER_BYTES + 5] ^= 1
    victim.write_bytes(bytes(raw))
    restarted = _disk_engine(tmp_path)
    again = _run(restarted, "b", prompt)
    assert again.num_cached_tokens == 4 * 4
    assert again.output_token_ids == plain.output_token_ids


def test_tier_sizes_that_hold_no_block_are_refused() -> None:
    with pytest.raises(ConfigError, match="holds no KV block"):
        _engine(kv_host_tier_bytes=BLOCK_BYTES - 1)


def test_checksums_catch_any_single_changed_word() -> None:
    from kvrail.worker.engine.kv_tiers.checksum import block_checksums

    region = torch.randint(0, 256, (4, 4096), dtype=torch.uint8)
    ids = torch.arange(4)
    before = block_checksums(region, ids)
    for offset in (0, 1, 2047, 4095):
        changed = region.clone()
        changed[1, offset] ^= 0x80
        after = block_checksums(changed, ids)
        assert after[1] != before[1] and torch.equal(after[[0, 2, 3]], before[[0, 2, 3]])


def test_a_disk_block_lost_since_the_scan_loads_the_blocks_before_it(tmp_path: Path) -> None:
    """Its read fails: the load stops there, the reads after it (still running, or done) end
    without a waiting load, and every slot and block comes back."""
    prompt = list(range(3, 43))
    plain = _run(_engine(), "plain", prompt)
    first = _disk_engine(tmp_path)
    a = _run(first, "a", prompt)
    _flush(first)
    restarted = _disk_engine(tmp_path)
    (tmp_path / f"{a.block_hashes[4].hex()}{SUFFIX}").unlink()  # gone after the scan
    again = _run(restarted, "b", prompt)
    assert again.num_cached_tokens == 4 * 4
    assert again.output_token_ids == plain.output_token_ids
    tiers = restarted.tiers
    assert tiers is not None
    _flush(restarted)  # block 4, computed again, is written behind again
    assert (tmp_path / f"{a.block_hashes[4].hex()}{SUFFIX}").exists()
    tiers.host.check_invariants()
    assert all(tiers.host.entry(h) is None or not tiers.host.entry(h).pins for h in a.block_hashes)
    assert_engine_empty(restarted)
