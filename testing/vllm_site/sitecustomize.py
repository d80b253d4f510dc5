"""Test-only start-up hook of the vLLM servers `kvrail.testing.vllm` starts: a NIXL progress-thread
poll delay. The harness puts this folder on those processes' PYTHONPATH (and on nothing else's),
so Python imports this module at start-up in the API server, EngineCore and worker processes.

Why: nixl's Python API (`nixl_agent.__init__` in `nixl_cu12/_api.py` and `nixl_cu13/_api.py`,
nixl 1.5.1) hard-codes `agent_config.pthrDelay = 0`, so the progress thread of every NIXL agent
polls UCX without pause and busy-spins a whole core, even when idle. vLLM's NIXL connector builds
the agent itself and exposes no setting for it. On a 2-core machine two idle servers (one prefill,
one decode) peg both cores, and the tests crawl. Turning the thread off instead stops the spinning
but makes TCP transfers progress only when the serving side polls (a 14 MB pull took 7.8 s, not
~15 ms). So this hook keeps the thread and makes it sleep between polls.

How: a meta-path finder wraps the loading of `nixl_cu12._api` / `nixl_cu13._api` and, once the
module is loaded, replaces its `nixlBind.nixlAgent` with a function that sets `pthrDelay` on the
config before building the agent. Driven by `KVRAIL_TEST_NIXL_PTHR_DELAY_US` (microseconds; the
harness sets 1000: idle CPU drops to ~3 % and a transfer takes 10-20 ms); unset, it does nothing.
Not for production: a GPU cluster has cores to spare, and nothing there loads this file.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

DELAY_ENV = "KVRAIL_TEST_NIXL_PTHR_DELAY_US"
_MODULES = ("nixl_cu12._api", "nixl_cu13._api")


def _patch(module: ModuleType, delay_us: int) -> None:
    bind = module.nixlBind
    real = bind.nixlAgent

    def nixl_agent(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return real(name, config)

    bind.nixlAgent = nixl_agent


class _NixlFinder(importlib.abc.MetaPathFinder):
    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _MODULES:
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        real_exec = loader.exec_module
        delay_us = self.delay_us

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            _patch(module, delay_us)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install() -> None:
    raw = os.environ.get(DELAY_ENV)
    if raw:
        sys.meta_path.insert(0, _NixlFinder(int(raw)))


_install()
