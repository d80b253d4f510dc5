from __future__ import annotations

import base64
import json
from array import array
from typing import Any

import pytest

from kvrail.codec import MAX_MESSAGE_BYTES, MessageError, decode
from kvrail.messages import Cancel, KvEvent, KvTierUsage, PrefillDone, PrefillJob, WorkerRecord
from kvrail.sampling import SamplingParams


def job(**overrides: Any) -> PrefillJob:
    base: dict[str, Any] = dict(
        request_id="req-1", token_ids=tuple(range(40)), fingerprint="f" * 64,
        dest_worker_id="decode-0", dest_incarnation=3, dest_agent_name="decode-0-3",
        dest_block_ids=(7, 8, 9), first_block_index=0, deadline_unix_s=1e9,
        sampling=SamplingParams(max_tokens=1),
    )  # fmt: skip
    base.update(overrides)
    return PrefillJob(**base)


@pytest.mark.parametrize(
    "message",
    [
        job(),
        job(
            sampling=SamplingParams(max_tokens=1, seed=42, temperature=0.7),
            tenant_salt="t1",
            with_checksums=True,
        ),
        PrefillDone(
            request_id="r",
            fingerprint="f",
            dest_incarnation=1,
            block_ids=(1, 2),
            first_token_id=5,
            num_prompt_tokens=20,
            prefill_worker_id="p-0",
            prefill_incarnation=2,
            block_checksums=("ab", "cd"),
        ),
        Cancel(request_id="r", reason="deadline"),
        KvEvent(worker_id="d-0", incarnation=1, seq=5, stored=("aa",), removed=("bb",)),
        WorkerRecord(worker_id="d-0", pod_uid="u", incarnation=1, role="decode", fingerprint="f"),
    ],
)
def test_every_message_round_trips(message: Any) -> None:
    assert decode(message.encode(), type(message)) == message


def test_token_ids_travel_packed_not_as_decimal_text() -> None:
    data = job(token_ids=tuple(range(10_000))).encode()
    assert len(data) < 10_000 * 8 * 1.4 + 1000


def _tamper(message: Any, **changes: Any) -> bytes:
    body = json.loads(message.encode())
    body.update(changes)
    return json.dumps(body).encode()


def _packed(values: list[int]) -> str:
    return base64.b64encode(array("q", values).tobytes()).decode()


@pytest.mark.parametrize(
    "data,message",
    [
        (b"\xff\xfe", "not valid JSON"),
        (b"[1,2]", "not a JSON object"),
        (_tamper(job(), v=2), "wire version"),
        (_tamper(job(), kind="cancel"), "expected a prefill_job"),
        (_tamper(job(), dest_incarnation="3"), "dest_incarnation must be int"),
        (_tamper(job(), dest_incarnation=True), "dest_incarnation must be int"),
        (_tamper(job(), dest_block_ids="!!notbase64"), "not valid base64"),
        (_tamper(job(), dest_block_ids=base64.b64encode(b"\x01\x02\x03").decode()), "truncated"),
        (_tamper(job(), dest_block_ids=_packed([1, -5])), "negative"),
        (_tamper(job(), token_ids=_packed([])), "token_ids is empty"),
        (_tamper(job(), request_id=""), "request_id"),
        (_tamper(job(), first_block_index=-1), "first_block_index"),
        (_tamper(Cancel(request_id="r"), reason="whim"), "reason"),
        (b"x" * (MAX_MESSAGE_BYTES + 1), "exceeds the limit"),
    ],
)
def test_malformed_or_hostile_messages_raise_message_error_only(data: bytes, message: str) -> None:
    with pytest.raises(MessageError, match=message):
        decode(data, PrefillJob if b"reason" not in data[:200] else Cancel)


def test_a_missing_required_field_is_named() -> None:
    body = json.loads(job().encode())
    del body["fingerprint"]
    with pytest.raises(MessageError, match="lacks field fingerprint"):
        decode(json.dumps(body).encode(), PrefillJob)


def test_errors_never_echo_payload_contents() -> None:
    secret = "the user's private prompt"
    with pytest.raises(MessageError) as err:
        decode(_tamper(job(), kind=secret), PrefillJob)
    assert secret not in str(err.value)


def test_a_worker_record_from_before_block_size_still_decodes_with_block_size_unknown() -> None:
    current = WorkerRecord(
        worker_id="d-0", pod_uid="u", incarnation=1, role="decode", fingerprint="f", block_size=16
    )
    body = json.loads(current.encode())
    del body["block_size"]  # what a worker built before the field existed publishes
    old = decode(json.dumps(body).encode(), WorkerRecord)
    assert old.block_size == 0
    assert old == WorkerRecord(
        worker_id="d-0", pod_uid="u", incarnation=1, role="decode", fingerprint="f"
    )
    assert decode(current.encode(), WorkerRecord).block_size == 16


def test_a_worker_records_kv_tiers_round_trip_and_a_record_without_them_has_none() -> None:
    tiers = (KvTierUsage("host", 3 << 30, 64 << 30, 192, num_hit_blocks=40, num_loads=5),)
    record = WorkerRecord(
        worker_id="d-0", pod_uid="u", incarnation=1, role="decode", fingerprint="f",
        kv_tiers=tiers,
    )  # fmt: skip
    assert decode(record.encode(), WorkerRecord).kv_tiers == tiers
    body = json.loads(record.encode())
    del body["kv_tiers"]  # what a worker built before tiers publishes
    assert decode(json.dumps(body).encode(), WorkerRecord).kv_tiers == ()


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ({"tier": "host", "used_bytes": -1, "capacity_bytes": 1, "num_blocks": 0}, "negative"),
        ({"tier": "gpu", "used_bytes": 0, "capacity_bytes": 1, "num_blocks": 0}, "GPU tier"),
        ({"tier": "ssd", "used_bytes": 0, "capacity_bytes": 1, "num_blocks": 0}, "tier"),
        ({"tier": "host", "used_bytes": 0, "capacity_bytes": 1}, "num_blocks"),
    ],
)
def test_a_worker_record_with_a_bad_tier_entry_is_refused(
    entry: dict[str, object], fragment: str
) -> None:
    record = WorkerRecord(
        worker_id="d-0", pod_uid="u", incarnation=1, role="decode", fingerprint="f"
    )
    body = json.loads(record.encode())
    body["kv_tiers"] = [entry]
    with pytest.raises(MessageError, match=fragment):
        decode(json.dumps(body).encode(), WorkerRecord)
