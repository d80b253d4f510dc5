from __future__ import annotations

from kvrail.cli.status import PoolStatus, render
from kvrail.keys import PoolKeys, parse_worker_key
from kvrail.messages import KvTierUsage, WorkerRecord


def worker(worker_id: str, role: str, **kw: object) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, pod_uid="u", incarnation=7, role=role,  # type: ignore[arg-type]
                        fingerprint="f", **kw)  # type: ignore[arg-type]  # fmt: skip


def test_render_lists_each_pool_with_its_workers_and_queue() -> None:
    text = render([
        PoolStatus("team-a", "llama", [
            worker("decode-0", "decode", is_ready=True, transport="nixl-ucx", num_running=3,
                   kv_utilization=0.42),
            worker("prefill-0", "prefill", transport="cuda-ipc"),
        ], queued_jobs=5),
        PoolStatus("team-b", "empty", [], queued_jobs=None, invalid_records=1),
    ])  # fmt: skip
    lines = text.splitlines()
    assert lines[0] == "pool team-a/llama: 1 decode, 1 prefill; 5 queued jobs"
    assert lines[1].split() == ["WORKER", "ROLE", "INCARNATION", "READY", "TRANSPORT", "RUNNING",
                                "WAITING", "KV"]  # fmt: skip
    assert lines[2].split() == ["decode-0", "decode", "7", "yes", "nixl-ucx", "3", "0", "42%"]
    assert lines[3].split()[:5] == ["prefill-0", "prefill", "7", "no", "cuda-ipc"]
    assert "pool team-b/empty: no workers; no prefill queue" in text
    assert "1 invalid worker records ignored" in text


def test_render_says_so_when_nothing_is_registered() -> None:
    assert render([]) == "no pools have registered workers\n"


def test_worker_keys_of_any_pool_parse_and_others_do_not() -> None:
    keys = PoolKeys("ns", "p")
    assert parse_worker_key(keys.worker("w-1")) == (keys, "w-1")
    for other in ("/kvrail/v1/ns/p/other/w", "/kvrail/v1/ns/p/workers/", "/x/ns/p/workers/w",
                  "/kvrail/v1/NS/p/workers/w", "/kvrail/v1/ns/p/workers/w/extra"):  # fmt: skip
        assert parse_worker_key(other) is None


def test_kv_use_shows_blocks_and_a_worker_the_stack_started_but_etcd_lost_is_listed() -> None:
    pools = [PoolStatus("default", "local", [
        worker("decode-0", "decode", is_ready=True, num_blocks=511, kv_utilization=0.12),
    ], queued_jobs=0)]  # fmt: skip
    lines = render(pools, expected_workers=("prefill-0", "decode-0")).splitlines()
    assert lines[2].split()[-3:] == ["12%", "(61/511", "blocks)"]
    assert lines[3].split() == ["prefill-0", "-", "-", "lost", "-", "-", "-", "-"]
    assert render([], expected_workers=("decode-0",)) == (
        "no pools have registered workers; lost: decode-0\n"
    )


def test_a_worker_with_kv_tiers_gets_a_line_per_tier_under_its_row() -> None:
    tiers = (
        KvTierUsage("host", used_bytes=12 << 30, capacity_bytes=64 << 30, num_blocks=768,
                    num_hit_blocks=4096, num_loads=310),
        KvTierUsage("disk", used_bytes=0, capacity_bytes=500 << 30, num_blocks=0),
    )  # fmt: skip
    pools = [PoolStatus("default", "p", [
        worker("decode-0", "decode", kv_tiers=tiers), worker("decode-1", "decode"),
    ], queued_jobs=0)]  # fmt: skip
    lines = render(pools).splitlines()
    assert lines[2].split()[0] == "decode-0"
    assert lines[3] == (
        "    host 12.0 GiB of 64.0 GiB (19%), 768 blocks, 4096 hit blocks, 310 loads"
    )
    assert lines[4] == "    disk 0 B of 500.0 GiB (0%), 0 blocks, 0 hit blocks, 0 loads"
    assert lines[5].split()[0] == "decode-1"
    assert len(lines) == 6
