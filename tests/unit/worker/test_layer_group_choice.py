"""`kv_transfer_layer_groups: auto` (docs/layerwise.md): the rule that picks a group count from
the link's bandwidth, the KV bytes, the prefill's seconds and a set-up cost; the moving
estimates it is fed; and the prefill role's choice per job. The live part (a worker choosing on
CPU, tokens equal to a colocated worker's) is in tests/integration/test_worker_layerwise_tp.py."""

from __future__ import annotations

from typing import cast

import pytest

from kvrail.errors import ConfigError, TransferError
from kvrail.messages import PrefillJob
from kvrail.sampling import SamplingParams
from kvrail.worker.roles.group_choice import BLOCK_DESCRIPTOR_S, GROUP_SETUP_S, GroupChoice
from kvrail.worker.transfer.blocks import TransferStats
from kvrail.worker.transfer.connector import Connector
from kvrail.worker.transfer.layer_groups import (
    MIN_SAVING_S,
    choose_num_groups,
    plan_groups,
)
from kvrail.worker.transfer.link_speed import (
    DEFAULT_NIXL_BYTES_PER_S,
    DecayedRatio,
    PeerBandwidth,
)

MS = 1e-3


def groups_for(transfer_s: float, prefill_s: float, setup_s: float, num_layers: int = 32) -> int:
    """The rule at 1 GB/s, so the KV bytes are the transfer's seconds times 1e9."""
    return choose_num_groups(round(transfer_s * 1e9), 1e9, prefill_s, setup_s, num_layers)


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
    "args", [(1, 0.0, 1.0, 0.0, 32), (-1, 1e9, 1.0, 0.0, 32), (1, 1e9, -1.0, 0.0, 32),
             (1, 1e9, 1.0, -1.0, 32), (1, 1e9, 1.0, 0.0, 0)],
)  # fmt: skip
def test_the_rule_refuses_impossible_inputs(args: tuple[int, float, float, float, int]) -> None:
    with pytest.raises(ValueError, match=r"bandwidth|layers"):
        choose_num_groups(*args)


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
    links = PeerBandwidth(max_peers=2)
    assert links.estimate("a", "nixl-ucx") == DEFAULT_NIXL_BYTES_PER_S == 3.125e9
    assert links.estimate("a", "cuda-ipc") == 1e12
    links.observe("a", TransferStats(4_000_000, 0.002, "nixl-ucx"))
    assert links.estimate("a", "nixl-ucx") == pytest.approx(2e9) and links.is_measured("a")
    links.observe("b", TransferStats(1_000_000, 0.001, "nixl-ucx"))
    links.observe("a", TransferStats(4_000_000, 0.002, "nixl-ucx"))  # a: the latest written
    links.observe("c", TransferStats(1_000_000, 0.001, "nixl-ucx"))  # b is forgotten
    assert not links.is_measured("b") and links.is_measured("a") and links.is_measured("c")


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
    # 160 tokens, 10 blocks of 1 MB over the default 25 Gb/s: 3.2 ms; a 1.6 s prefill; a group
    # costs its set-up and one NIXL descriptor per block.
    setup = GROUP_SETUP_S + 10 * BLOCK_DESCRIPTOR_S
    expected = choose_num_groups(10_000_000, DEFAULT_NIXL_BYTES_PER_S, 1.6, setup, 30)
    assert expected > 0 and auto.plan(job(160)) == plan_groups(30, expected)
    auto.wrote("decode-0-7", TransferStats(10_000_000, 0.1, "nixl-ucx"))  # measured: 100 MB/s
    expected = choose_num_groups(10_000_000, 1e8, 1.6, setup, 30)
    assert auto.plan(job(160)) == plan_groups(30, expected)
    assert auto.plan(job(160, peer="gone-1")) != auto.plan(job(160))  # its default, unmeasured
    auto.wrote("decode-0-7", TransferStats(10_000_000, 0.0, "nixl-ucx"))  # untimed: no change
    assert auto.plan(job(160)) == plan_groups(30, expected)


def test_auto_counts_only_what_the_job_moves_and_the_last_steps_share_of_a_long_prompt() -> None:
    auto = choice("auto", step_tokens=64)
    auto.computed(100, 1.0)
    auto.wrote("decode-0-7", TransferStats(10_000_000, 0.1, "nixl-ucx"))
    # 320 tokens after 4 cached blocks: 256 computed, 16 blocks moved; steps of 64 tokens, so
    # the groups carry about a quarter of them, while a quarter of the prefill runs.
    setup = GROUP_SETUP_S + 4 * BLOCK_DESCRIPTOR_S
    expected = choose_num_groups(4_000_000, 1e8, 0.64, setup, 30)
    assert auto.plan(job(320, first_block_index=4)) == plan_groups(30, expected)


def test_a_groups_set_up_over_nixl_grows_with_its_blocks_and_not_over_cuda_ipc() -> None:
    """Over NIXL a group is one descriptor per block (measured: about 30 us each on the lent
    H100), so a prompt of many blocks goes in fewer groups than over CUDA IPC."""
    nixl, ipc = choice("auto"), choice("auto")
    cast(FakeConnector, ipc._connector).peers["decode-0-7"] = "cuda-ipc"
    for auto in (nixl, ipc):
        auto.computed(8192, 0.3)
        auto.wrote("decode-0-7", TransferStats(512_000_000, 0.4, "nixl-ucx"))  # 1.28 GB/s
    # 8192 tokens: 512 blocks of 1 MB, 0.4 s on the link, a 0.3 s prefill.
    many = job(8192)
    assert len(nixl.plan(many)) == choose_num_groups(
        512_000_000, 1.28e9, 0.3, GROUP_SETUP_S + 512 * BLOCK_DESCRIPTOR_S, 30
    )
    assert len(ipc.plan(many)) == choose_num_groups(512_000_000, 1.28e9, 0.3, GROUP_SETUP_S, 30)
    assert 0 < len(nixl.plan(many)) < len(ipc.plan(many))
