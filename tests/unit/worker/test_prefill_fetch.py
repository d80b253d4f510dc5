"""How many prefill jobs a prefill worker fetches: while the prompts it holds and has not
computed yet fit in one engine step, so the next step is full and no backlog waits on one worker
that another could run. The whole role runs against a real queue in
tests/integration/test_worker_disaggregated.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from kvrail.settings import Settings
from kvrail.worker.roles.context import WorkerContext
from kvrail.worker.roles.prefill import PrefillRole


def prefill_role(step_tokens: int) -> PrefillRole:
    ctx = SimpleNamespace(
        settings=Settings(max_num_batched_tokens=step_tokens), keys=None, worker_id="prefill-0",
        incarnation=1, fingerprint="f" * 64, block_size=16, nc=None, prefill_queue=None,
        service=None, connector=None, peers=SimpleNamespace(listen=lambda _callback: None),
    )  # fmt: skip
    return PrefillRole(cast(WorkerContext, ctx))


def test_jobs_are_fetched_while_the_prompts_to_compute_fit_in_one_step() -> None:
    role = prefill_role(step_tokens=1000)
    assert role._has_room()
    first = role._computing(600)
    assert role._has_room()  # 600 of 1,000: another prompt still fits the next step
    second = role._computing(600)
    assert not role._has_room()
    first()  # computed: it writes now, and no longer takes room in a step
    assert role._has_room() and role._room.is_set()
    first()  # idempotent
    assert role._tokens_to_compute == 600
    second()
    assert role._tokens_to_compute == 0


def test_one_prompt_longer_than_a_step_is_fetched_alone() -> None:
    role = prefill_role(step_tokens=512)
    done = role._computing(8192)
    assert not role._has_room()
    done()
    assert role._has_room()
