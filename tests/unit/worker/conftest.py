"""Fixtures for the worker tests: one torch thread, and the real SmolLM2 loaded once.

One thread on purpose: CI shares its cores with other jobs, and OpenMP threads that spin-wait on
an oversubscribed machine made these tests 5-10x slower than a single thread does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _torch_threads() -> Iterator[None]:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """The real SmolLM2-135M-Instruct (config, state dict, tokenizer) from the converted cache."""
    from kvrail.worker.models.loader import load

    return load("smollm2")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2: Any) -> Any:
    """The transformers model for SmolLM2, float32, the oracle of the correctness tests."""
    from kvrail.worker.models.loader import load_transformers_model

    return load_transformers_model("smollm2")
