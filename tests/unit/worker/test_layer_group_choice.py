"""`kv_transfer_layer_groups: auto` (docs/layerwise.md): the rule that picks a group count from
the link's bandwidth, the KV bytes and blocks, the prefill's seconds and what a write costs; the
moving estimates it is fed; and the prefill role's choice per job. The live part (a worker
choosing on CPU, tokens equal to a colocated worker's) is in
tests/integration/test_worker_layerwise_tp.py."""

from __future__ import annotations

from typing import cast

import pytest

from kvrail.errors import ConfigError, TransferError
from kvrail.messages import PrefillJob
from kvrail.sampling import SamplingParams
from kvrail.worker.roles.group_choice import GROUP_SETUP_S, GroupChoice
from kvrail.worker.transfer.blocks import TransferStats
from kvrail.worker.transfer.connector import Connector
from kvrail.worker.transfer.layer_groups import (
    MIN_SAVING_S,
    WriteCost,
    choose_num_groups,
    lands_s,
    plan_groups,
)
from kvrail.worker.transfer.link_speed import (
    BUSY_BLOCK_S,
    DEFAULT_NIXL_BYTES_PER_S,
    IDLE_BLOCK_S,
    DecayedRatio,
    PeerLinks,
    WriteTiming,
)

MS = 1e-3


def groups_for(transfer_s: float, prefill_s: float, setup_s: float, num_layers: int = 32) -> int:
    """The rule at 1 GB/s (the KV bytes are the transfer's seconds times 1e9), no per-block cost."""
    return choose_num_groups(
        round(transfer_s * 1e9), 1e9, prefill_s, 100, WriteCost(setup_s), num_layers
    )


def whole(num_bytes: int, seconds: float, num_blocks: int = 10) -> tuple[WriteTiming]:
    return (WriteTiming.whole(TransferStats(num_bytes, seconds, "nixl-ucx"), num_blocks),)


def test_a_prefill_as_long_as_the_transfer_takes_the_square_root_of_prefill_over_setup() -> None:
    # P = T = 40 ms, c = 1 ms: the link-bound end decides, 40 + 40/G + G ms, least at G = 6
    # (52.67 ms, against 81 ms whole).
    assert groups_for(40 * MS, 40 * MS, 1 * MS) == 6


def test_a_link_slower_than_the_prefill_saves_at_most_the_prefill() -> None:
    # T = 1 s, P = 10 ms, c = 0.5 ms: 1000 + 10/G + G/2 ms, least at G = 4 or 5 (1004.5 ms):
    # the fewer; 6 ms saved against a whole write (1010.5 ms), under P.
    assert groups_for(1.0, 10 * MS, 0.5 * MS) == 4


def test_a_long_prefill_hides_every_setup_and_gets_up_to_one_group_per_layer() -> None:
    assert groups_for(1.0, 10.0, 0.0, num_layers=30) == 30
    assert groups_for(1.0, 10.0, 0.0, num_layers=3) == 3


@pytest.mark.parametrize(
    ("transfer_s", "prefill_s", "setup_s"),
    [
        (0.5 * MS, 1.0, 0.0),  # a transfer under a millisecond: nothing to hide
        (1.2 * MS, 0.1, 0.5 * MS),  # groups save 0.9 ms at best
        (1.0, 0.0, 0.5 * MS),  # no prefill to overlap
        (20 * MS, 20 * MS, 50 * MS),  # set-ups dearer than what they hide
    ],
)
def test_overlap_that_saves_under_a_millisecond_is_a_whole_write(
    transfer_s: float, prefill_s: float, setup_s: float
) -> None:
    assert groups_for(transfer_s, prefill_s, setup_s) == 0


def test_groups_stop_where_one_more_saves_almost_nothing() -> None:
    # T = 1.5 ms, P = 100 ms, c = 0.5 ms: the tail is 1.5/G ms; a fifth group would save
    # 0.075 ms, under the 0.1 ms a group must; four save 1.125 ms against a whole write.
    assert groups_for(1.5 * MS, 0.1, 0.5 * MS) == 4
    assert MIN_SAVING_S == 1 * MS


@pytest.mark.parametrize(
    "args", [(1, 0.0, 1.0, 1, 32), (-1, 1e9, 1.0, 1, 32), (1, 1e9, -1.0, 1, 32),
             (1, 1e9, 1.0, -1, 32), (1, 1e9, 1.0, 1, 0)],
)  # fmt: skip
def test_the_rule_refuses_impossible_inputs(args: tuple[int, float, float, int, int]) -> None:
    kv_bytes, bandwidth, prefill_s, num_blocks, num_layers = args
    with pytest.raises(ValueError, match=r"bandwidth|layers"):
        choose_num_groups(kv_bytes, bandwidth, prefill_s, num_blocks, WriteCost(0.0), num_layers)
    with pytest.raises(ValueError, match="negative"):
        WriteCost(1e-3, busy_block_s=-1e-6)


@pytest.mark.parametrize("groups", [1, 2, 3, 5, 8, 32])
@pytest.mark.parametrize(("transfer_s", "prefill_s", "setup_s"), [(0.04, 0.04, 1e-3),
                         (1.0, 0.01, 5e-4), (0.2, 0.9, 2e-3), (0.3, 0.3, 0.0)])  # fmt: skip
def test_without_a_per_block_cost_a_chain_of_writes_lands_as_the_closed_form_says(
    groups: int, transfer_s: float, prefill_s: float, setup_s: float
) -> None:
    closed = max(
        prefill_s + transfer_s / groups + setup_s,
        prefill_s / groups + transfer_s + groups * setup_s,
    )
    assert lands_s(groups, transfer_s, prefill_s, 512, WriteCost(setup_s)) == pytest.approx(closed)


def test_descriptors_dear_while_the_prefill_runs_make_a_few_large_groups_best() -> None:
    """The lent H100's 8k prompt (bench/transfer/layerwise_auto_h100_2026-12-07.txt): a 210 ms
    prefill, 1.07 GB over a 5 GB/s cap (215 ms), 512 blocks, a group written during the prefill
    paying about 150 us a block and one after it only its bytes. Measured: whole 425 ms, 2
    groups 316 ms; a rule blind to the regimes chose 13-32 groups there (397 ms)."""
    cost = WriteCost(GROUP_SETUP_S, busy_block_s=150e-6, idle_block_s=10e-6)
    transfer_s, prefill_s = 1.074e9 / 5e9, 0.210

    def at(groups: int) -> float:
        return lands_s(groups, transfer_s, prefill_s, 512, cost)

    assert at(1) == pytest.approx(prefill_s + transfer_s + GROUP_SETUP_S)  # a whole write
    assert at(2) == pytest.approx(0.320, abs=1e-3)  # the first group's bytes hide its blocks
    assert at(3) == pytest.approx(0.2915, abs=1e-3)  # the second pays busy until 210 ms only
    assert at(4) > at(3) and at(16) > at(2)  # each group during the prefill pays up to 77 ms
    assert choose_num_groups(1_074_000_000, 5e9, prefill_s, 512, cost, 32) == 3
    cheap = WriteCost(GROUP_SETUP_S, busy_block_s=10e-6, idle_block_s=10e-6)
    assert choose_num_groups(1_074_000_000, 5e9, prefill_s, 512, cheap, 32) > 3


def test_a_write_begun_during_the_prefill_pays_the_busy_cost_only_until_it_ends() -> None:
    """The lent H100's 32k prompt (bench/transfer/layerwise_h100_2026-12-07c.txt): a 1.19 s
    prefill, 4.3 GB over a 5 GB/s cap (859 ms), 2048 blocks, about 460 us a block while the
    prefill runs. A first group of 2 landed about 20 ms after the prefill ended and the
    second its bytes' 430 ms later (1.63 s measured); 4 groups took 1.84 s. Charging the busy
    cost for a whole write begun during the prefill put 2 groups at 1.97 s and chose 4."""
    cost = WriteCost(GROUP_SETUP_S, busy_block_s=460e-6, idle_block_s=10e-6)
    transfer_s, prefill_s = 0.859, 1.19

    def at(groups: int) -> float:
        return lands_s(groups, transfer_s, prefill_s, 2048, cost)

    assert at(2) == pytest.approx(1.628, abs=5e-3)
    assert at(4) == pytest.approx(1.837, abs=5e-3)
    assert choose_num_groups(4_295_000_000, 5e9, prefill_s, 2048, cost, 32) == 2
    # the blocks still owed when the prefill ends go at the idle cost
    assert cost.blocks_done_s(0.595, 2048, prefill_s) == pytest.approx(
        prefill_s + (2048 - 0.595 / 460e-6) * 10e-6
    )
    assert cost.blocks_done_s(1.0, 100, prefill_s) == pytest.approx(1.0 + 100 * 460e-6)
    assert cost.blocks_done_s(1.5, 100, prefill_s) == pytest.approx(1.5 + 100 * 10e-6)


def test_a_decayed_ratio_is_a_ratio_of_sums_whose_old_samples_fade() -> None:
    ratio = DecayedRatio(half_life=1.0)
    assert ratio.value is None
    ratio.add(10.0, 1.0)
    assert ratio.value == 10.0
    ratio.add(30.0, 1.0)  # the first now weighs half: (5 + 30) / (0.5 + 1)
    assert ratio.value == pytest.approx(35.0 / 1.5)
    ratio.add(5.0, 0.0)  # untimed: ignored
    ratio.add(-1.0, 1.0)
    assert ratio.value == pytest.approx(35.0 / 1.5)
    sizes = DecayedRatio(half_life=8.0)
    sizes.add(1e9, 1.0)  # a 1 GB write at 1 GB/s
    sizes.add(1e3, 1e-3)  # a 1 kB write that its set-up dominated (1 MB/s)
    assert sizes.value == pytest.approx(1e9, rel=0.01)  # weighs as little as it moved
    with pytest.raises(ValueError, match="half-life"):
        DecayedRatio(half_life=0.0)


def test_a_peers_bandwidth_is_measured_from_its_writes_and_defaults_by_path_before() -> None:
    links = PeerLinks(max_peers=2)
    assert links.estimate("a", "nixl-ucx").bytes_per_s == DEFAULT_NIXL_BYTES_PER_S == 3.125e9
    assert links.estimate("a", "cuda-ipc").bytes_per_s == 1e12
    assert not links.estimate("a", "nixl-ucx").measured
    links.observe("a", whole(4_000_000, 0.002))
    assert links.estimate("a", "nixl-ucx").bytes_per_s == pytest.approx(2e9)
    assert links.estimate("a", "nixl-ucx").measured
    links.observe("b", whole(1_000_000, 0.001))
    links.observe("a", whole(4_000_000, 0.002))  # a: the latest written
    links.observe("c", whole(1_000_000, 0.001))  # b is forgotten
    assert [links.estimate(p, "nixl-ucx").measured for p in "abc"] == [True, False, True]


def test_writes_during_the_prefill_teach_the_busy_block_cost_and_later_ones_the_bandwidth() -> None:
    links = PeerLinks()
    assert links.estimate("a", "nixl-ucx").busy_block_s == BUSY_BLOCK_S  # nothing timed yet
    links.observe("a", whole(1_000_000_000, 0.2, num_blocks=512))  # 5 GB/s
    # a layer-wise job: two groups during the prefill, 33.5 MB each (6.7 ms of bytes) taking
    # 80 ms for 512 blocks, then one after it at the link's rate
    links.observe("a", (
        WriteTiming(33_500_000, 512, 0.080, landed_s=-0.100),
        WriteTiming(33_500_000, 512, 0.080, landed_s=-0.020),
        WriteTiming(33_500_000, 512, 0.0067, landed_s=0.010),
    ))  # fmt: skip
    link = links.estimate("a", "nixl-ucx")
    assert link.busy_block_s == pytest.approx(0.080 / 512)
    assert link.bytes_per_s == pytest.approx(1_033_500_000 / 0.2067, rel=1e-3)  # idle writes only
    # a group during the prefill whose bytes took their time says only that a block cost at
    # most 0.1 ms, which lowers an estimate above that
    links.observe("a", (WriteTiming(500_000_000, 512, 0.1, landed_s=-0.01),))
    assert links.estimate("a", "nixl-ucx").busy_block_s < 0.080 / 512
    fast = PeerLinks()
    fast.observe("b", whole(1_000_000_000, 0.02, num_blocks=512))  # 50 GB/s
    fast.observe("b", (WriteTiming(100_000_000, 512, 0.0021, landed_s=-0.05),))  # bytes-bound
    assert fast.estimate("b", "nixl-ucx").busy_block_s == pytest.approx(0.0021 / 512)
    fast.observe("b", (WriteTiming(100_000_000, 512, 0.0, landed_s=-0.05),))  # untimed: nothing
    assert fast.estimate("b", "nixl-ucx").busy_block_s == pytest.approx(0.0021 / 512)


class Region:
    num_layers = 30


class FakeConnector:
    """What `GroupChoice` reads of a connector: its layers, block bytes and paths."""

    transport = "nixl-ucx"

    def __init__(self, supports_layers: bool = True) -> None:
        self.supports_layers = supports_layers
        self.region = Region()
        self.block_bytes = 1_000_000
        self.peers = {"decode-0-7": "nixl-ucx"}

    def transport_to(self, peer: str) -> str:
        if peer not in self.peers:
            raise TransferError(f"unknown or removed peer {peer}")
        return self.peers[peer]


def job(num_tokens: int, first_block_index: int = 0, peer: str = "decode-0-7") -> PrefillJob:
    num_blocks = -(-num_tokens // 16) - first_block_index
    return PrefillJob(
        request_id="r-1", token_ids=tuple(range(num_tokens)), fingerprint="f" * 64,
        dest_worker_id="decode-0", dest_incarnation=7, dest_agent_name=peer,
        dest_block_ids=tuple(range(num_blocks)), first_block_index=first_block_index,
        deadline_unix_s=2e9, sampling=SamplingParams(max_tokens=1),
    )  # fmt: skip


def choice(setting: int | str, step_tokens: int = 8192, **kw: bool) -> GroupChoice:
    return GroupChoice(setting, cast(Connector, FakeConnector(**kw)), 16, step_tokens)


def test_a_fixed_count_is_every_jobs_plan_and_zero_is_a_whole_write() -> None:
    assert choice(4).plan(job(160)) == plan_groups(30, 4) == (8, 16, 23, 30)
    assert choice(0).plan(job(160)) == ()
    assert choice(0, supports_layers=False).plan(job(160)) == ()
    for setting in (4, "auto"):
        with pytest.raises(ConfigError, match="kv_transfer_layer_groups"):
            choice(setting, supports_layers=False)


def test_auto_writes_whole_until_a_prefill_was_measured_then_follows_the_rule() -> None:
    auto = choice("auto")
    assert auto.plan(job(160)) == ()  # nothing measured: the whole write measures both
    auto.computed(100, 1.0)  # 10 ms per token
    # 160 tokens, 10 blocks of 1 MB over the default 25 Gb/s: 3.2 ms; a 1.6 s prefill; a
    # write costs its set-up and, over NIXL, per block (one descriptor each).
    cost = WriteCost(GROUP_SETUP_S, BUSY_BLOCK_S, IDLE_BLOCK_S)
    expected = choose_num_groups(10_000_000, DEFAULT_NIXL_BYTES_PER_S, 1.6, 10, cost, 30)
    assert expected > 0 and auto.plan(job(160)) == plan_groups(30, expected)
    auto.wrote("decode-0-7", whole(10_000_000, 0.1))  # measured: 100 MB/s
    expected = choose_num_groups(10_000_000, 1e8, 1.6, 10, cost, 30)
    assert auto.plan(job(160)) == plan_groups(30, expected)
    assert auto.plan(job(160, peer="gone-1")) != auto.plan(job(160))  # its default, unmeasured
    auto.wrote("decode-0-7", whole(10_000_000, 0.0))  # untimed: no change
    assert auto.plan(job(160)) == plan_groups(30, expected)


def test_auto_counts_only_what_the_job_moves_and_the_last_steps_share_of_a_long_prompt() -> None:
    auto = choice("auto", step_tokens=64)
    auto.computed(100, 1.0)
    auto.wrote("decode-0-7", whole(10_000_000, 0.1))
    # 320 tokens after 4 cached blocks: 256 computed, 16 blocks moved; steps of 64 tokens, so
    # the groups carry about a quarter of them, while a quarter of the prefill runs.
    cost = WriteCost(GROUP_SETUP_S, BUSY_BLOCK_S, IDLE_BLOCK_S)
    expected = choose_num_groups(4_000_000, 1e8, 0.64, 4, cost, 30)
    assert auto.plan(job(320, first_block_index=4)) == plan_groups(30, expected)


def test_over_nixl_blocks_cost_a_group_and_what_they_cost_is_learned() -> None:
    """Over NIXL each block of a group is a descriptor, dear while the prefill runs (about 150
    us on the lent H100), so a prompt of many blocks goes in a few groups; once the groups' own
    writes show the blocks cheaper, in more. Over CUDA IPC it goes whole whatever the link: the
    copies would take SMs from the prefill they overlap."""
    nixl, ipc = choice("auto"), choice("auto")
    cast(FakeConnector, ipc._connector).peers["decode-0-7"] = "cuda-ipc"
    for auto in (nixl, ipc):
        auto.computed(8192, 0.3)
        auto.wrote("decode-0-7", whole(512_000_000, 0.4, num_blocks=512))  # 1.28 GB/s
    # 8192 tokens: 512 blocks of 1 MB, 0.4 s on the link, a 0.3 s prefill.
    many = job(8192)
    busy = WriteCost(GROUP_SETUP_S, BUSY_BLOCK_S, IDLE_BLOCK_S)
    assert len(nixl.plan(many)) == choose_num_groups(512_000_000, 1.28e9, 0.3, 512, busy, 30)
    assert ipc.plan(many) == ()
    before = len(nixl.plan(many))
    assert before > 0
    # the job's groups during the prefill took their bytes' time: the blocks cost less
    nixl.wrote("decode-0-7", tuple(
        WriteTiming(64_000_000, 512, 0.05, landed_s=-0.3 + 0.0375 * (g + 1)) for g in range(8)
    ))  # fmt: skip
    assert len(nixl.plan(many)) > before
