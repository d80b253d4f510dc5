"""The NIXL progress-thread hook the vLLM test servers start with
(`testing/vllm_site/sitecustomize.py`), on the nixl-cu12 kvrail itself installs: every agent
nixl builds gets the configured poll delay, and nothing changes when the variable is unset. Also
the hint a missing `.venv-vllm` gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrail.testing.vllm import SITE_DIR, VllmEnvMissing, vllm_python

# What nixl_agent.__init__ does: a config with pthrDelay 0, then the binding's agent.
PROBE = """
import nixl_cu12._api as api
config = api.nixlBind.nixlAgentConfig()
config.pthrDelay = 0
api.nixlBind.nixlAgent("probe", config)
print(config.pthrDelay)
"""


@pytest.mark.parametrize(
    ("delay", "expected"), [("1000", "1000"), (None, "0")], ids=["set", "unset"]
)
def test_the_hook_sets_the_progress_thread_delay_only_when_asked(
    delay: str | None, expected: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVRAIL_TEST_NIXL_PTHR_DELAY_US"}
    env["PYTHONPATH"] = str(SITE_DIR)  # as the harness starts vLLM
    if delay is not None:
        env["KVRAIL_TEST_NIXL_PTHR_DELAY_US"] = delay
    done = subprocess.run(
        [sys.executable, "-P", "-c", PROBE], env=env, capture_output=True, text=True,
        timeout=60, check=False, cwd=SITE_DIR,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == expected


def test_a_missing_vllm_env_names_the_make_target(tmp_path: Path) -> None:
    with pytest.raises(VllmEnvMissing, match="run `make vllm-env`"):
        vllm_python(tmp_path / ".venv-vllm")
