"""Faults under load: each component killed (-9) and restarted while clients send requests.

A short run of `kvrail.testing.soak` (the soak script `bench/soak/run.py` runs it longer): its
own etcd and NATS (they are killed too, so not the session's), `prefill-0`, `decode-0`,
`decode-1` and a router, SmolLM2 on CPU, three clients through the real `openai` client. For
every scenario: no request is lost (each completes or fails with a clear error within its
deadline), every completed answer equals the one recorded before any fault, requests complete
again after the restart, and no KV block stays held on any worker. Then every log of the run
(etcd, NATS, workers, router; faults make components log the most) is scanned for the prompts
and the answers: none may appear, not even four words of one.
"""

from __future__ import annotations

import pytest

from kvrail.testing.soak import COMPONENTS, FAULTS, prompts, run_soak, table

pytestmark = pytest.mark.timeout(900)


async def test_every_component_killed_and_restarted_under_load_loses_nothing(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("soak")
    results, answers = await run_soak(
        root, COMPONENTS + FAULTS, window_s=24.0, fault_after_s=6.0, down_s=2.0, fault_s=8.0,
        deadline_s=15.0, settle_s=45.0,
    )  # fmt: skip
    report = table(results) + f"\nlogs: {root}"
    assert [r.component for r in results] == list(COMPONENTS + FAULTS)
    for r in results:
        assert r.outcomes["lost"] == 0, report
        assert r.outcomes["wrong"] == 0, report
        assert r.blocks_leaked == 0, report
        assert r.outcomes["completed"] > 0, report
        assert r.recovery_s is not None, report  # requests completed after the restart
    print(report)
    prefill_logs = "".join(p.read_text() for p in root.rglob("prefill-0.*.log"))
    for fault in ("failing a KV write", "losing a KV notification"):
        assert f"fault injection: {fault}" in prefill_logs  # the faults did happen
    assert prefill_logs.count("prefill written") >= 50, "too few remote prefills to mean much"
    assert sorted(answers) == sorted(prompts(6, 60))  # what the clients sent (the defaults)
    fragments = {" ".join(p.split()[i : i + 4]) for p in answers for i in range(0, 56, 4)}
    fragments |= {a.strip() for a in answers.values() if len(a.strip()) >= 12}
    logs = sorted(root.rglob("*.log"))
    assert len(logs) >= 8, logs  # etcd, NATS, 3 workers, router, and the restarted ones
    for path in logs:
        text = path.read_text(errors="replace")
        leaked = [f for f in fragments if f in text]
        assert not leaked, f"{path} holds prompt text: {leaked[:3]}"
