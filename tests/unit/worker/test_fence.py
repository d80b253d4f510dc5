"""DeviceFence: a remote writer starts only once the device work queued before its
reservation has finished."""

from __future__ import annotations

import pytest
import torch

from kvrail.sampling import SamplingParams
from kvrail.worker.engine.fence import PASSED, DeviceFence
from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config


def test_on_the_cpu_a_fence_has_always_passed() -> None:
    fence = DeviceFence.now(torch.device("cpu"))
    assert fence is PASSED and fence.passed()


def test_a_reservation_carries_a_fence_taken_when_it_was_made() -> None:
    engine = make_engine(tiny_llama_config(), seed=0, num_blocks=32)
    reservation = engine.reserve_remote("r", list(range(10, 30)), SamplingParams(max_tokens=2))
    assert reservation is not None and reservation.fence.passed()
    engine.abort("r")
    assert_engine_empty(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_fence_passes_only_after_the_work_queued_before_it() -> None:
    device = torch.device("cuda")
    torch.cuda._sleep(2_000_000_000)  # about a second of device time, queued
    fence = DeviceFence.now(device)
    assert not fence.passed()
    torch.cuda.synchronize()
    assert fence.passed()
