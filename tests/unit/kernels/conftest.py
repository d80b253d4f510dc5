"""Kernel test fixtures: one torch thread (see tests/unit/worker/conftest.py for why)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _torch_threads() -> None:
    torch.set_num_threads(1)
