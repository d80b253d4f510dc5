"""Loaded through PYTHONPATH by the processes bench/routing/run.py and
bench/studies/routing/idle_cpu.py start (unless run.py is given `--nixl-progress-thread on`):
NIXL agents are created without their progress thread.

Why: with `enable_prog_thread=True` (the default of NIXL's Python `nixl_agent_config`), NIXL's UCX
backend runs a shared progress thread (`nixlUcxSharedThread`) that polls with a zero timeout (its
`pthrDelay` is 0): an idle kvrail worker keeps a core busy in it (bench/studies/routing/idle_cpu.py
measures it). Colocated workers never transfer KV, so the thread has nothing to do in this
experiment, and on two cores it takes CPU from the model. This changes NIXL's default in the
benchmark's processes only; kvrail's code is unchanged.
"""

from __future__ import annotations

import importlib
from typing import Any


def _without_progress_thread(api: Any) -> None:
    original = api.nixl_agent_config.__init__

    def __init__(self: Any, *args: Any, enable_prog_thread: bool = False, **kw: Any) -> None:
        original(self, *args, enable_prog_thread=enable_prog_thread, **kw)

    api.nixl_agent_config.__init__ = __init__


def _patch() -> None:
    for name in (
        "nixl._api",
        "nixl_cu12._api",
    ):  # the order kvrail.worker.transfer.kv_connector uses
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        _without_progress_thread(api)
        return


_patch()
