"""A router pinned to one decode worker (a pod's HTTP front, `--pin-worker`): the dispatcher
chooses that worker whatever the others cache, and none when it is gone; `/ready`'s workers and
the context length are that worker's."""

from __future__ import annotations

from typing import Any

import pytest

from kvrail.keys import PoolKeys
from kvrail.messages import KvEvent, WorkerRecord
from kvrail.router.discovery.index import prompt_hashes
from kvrail.router.discovery.view import WorkerView
from kvrail.router.generate import RouterState, context_len
from kvrail.router.policy import Chooser, NoWorkerError
from kvrail.router.streams.dispatcher import Dispatcher, Job
from kvrail.sampling import SamplingParams

FINGERPRINT = "c" * 64
TOKENS = tuple(range(64))  # 16 blocks of 4


class _Unconnected:
    def new_inbox(self) -> str:
        return "_INBOX.unit"


def dispatcher(pin_worker: str = "") -> Dispatcher:
    keys = PoolKeys("default", "unit")
    view = WorkerView(None, None, keys)  # type: ignore[arg-type]  # never started: fed below
    for worker_id, cached, max_model_len in (("d-0", 0, 1024), ("d-1", 16, 512)):
        hashes = prompt_hashes(TOKENS, 4, FINGERPRINT)[:cached]
        view.index.load_state(KvEvent(worker_id=worker_id, incarnation=1, seq=0,
                                      stored=tuple(hashes), cleared=True))  # fmt: skip
        view._apply_record(worker_id, WorkerRecord(
            worker_id=worker_id, pod_uid=worker_id, incarnation=1, role="decode",
            fingerprint=FINGERPRINT, block_size=4, max_model_len=max_model_len, is_ready=True,
        ))  # fmt: skip
    nc: Any = _Unconnected()
    return Dispatcher(nc, keys, view, Chooser("kv-aware"), 4, pin_worker=pin_worker)


JOB = Job("r-1", TOKENS, SamplingParams(max_tokens=4), 0.0)


def state_of(d: Dispatcher) -> RouterState:
    none: Any = None
    return RouterState(
        codec=none, dispatcher=d, view=d.view, tenants=none, admission=none,
        metrics=none, served_name="m", max_model_len=0, request_timeout_s=1,
    )  # fmt: skip


def test_unpinned_the_worker_caching_the_prompt_wins() -> None:
    d = dispatcher()
    assert d.choose(JOB, set()).worker_id == "d-1"
    assert context_len(state_of(d)) == 512


def test_pinned_the_pinned_worker_is_chosen_whatever_the_others_cache() -> None:
    d = dispatcher("d-0")
    assert d.choose(JOB, set()).worker_id == "d-0"
    assert [r.worker_id for r in d.decode_workers()] == ["d-0"]
    assert context_len(state_of(d)) == 1024
    with pytest.raises(NoWorkerError):  # a retry never goes to another worker
        d.choose(JOB, {"d-0"})


def test_pinned_to_a_worker_that_is_not_ready_nothing_is_chosen() -> None:
    d = dispatcher("d-9")
    assert d.decode_workers() == []
    with pytest.raises(NoWorkerError):
        d.choose(JOB, set())
