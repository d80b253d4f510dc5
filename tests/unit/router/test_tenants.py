"""API keys and per-tenant limits (pure; a fake clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrail.errors import ConfigError
from kvrail.router.tenants import ANONYMOUS_TENANT, Admission, Rejected, TenantTable, key_digest

KEYS = {
    "tenants": {
        "team-a": {"keys": ["sk-a"], "maxConcurrentRequests": 2},
        "team-b": {"keySha256": [key_digest("sk-b")], "tokensPerMinute": 600},
    }
}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_without_a_file_everyone_is_the_anonymous_tenant_with_an_empty_salt() -> None:
    table = TenantTable.load(None)
    assert not table.enabled
    assert table.authenticate(None) is ANONYMOUS_TENANT and ANONYMOUS_TENANT.salt == ""


def test_keys_plain_or_hashed_map_to_their_tenant_and_salts_differ(tmp_path: Path) -> None:
    path = tmp_path / "api-keys.yaml"
    digest = key_digest("sk-b")
    path.write_text(f"tenants:\n  team-a: {{keys: [sk-a]}}\n  team-b: {{keySha256: [{digest}]}}\n")
    table = TenantTable.load(path)
    a = table.authenticate("Bearer sk-a")
    b = table.authenticate("bearer  sk-b")
    assert (a.name, b.name) == ("team-a", "team-b")
    assert a.salt != b.salt


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic sk-a", "Bearer sk-wrong"])
def test_a_missing_or_wrong_key_is_refused_with_401(header: str | None) -> None:
    with pytest.raises(Rejected) as err:
        TenantTable.parse(KEYS).authenticate(header)
    assert err.value.status == 401
    assert "sk-" not in err.value.message  # never echo a key


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({}, "'tenants' mapping"),
        ({"tenants": {"Team A": {"keys": ["k"]}}}, "DNS-1123"),
        ({"tenants": {"a": {"keys": []}}}, "has no keys"),
        ({"tenants": {"a": {"keys": ["k"], "extra": 1}}}, "unknown fields"),
        ({"tenants": {"a": {"keySha256": ["abc"]}}}, "64 hex digits"),
        ({"tenants": {"a": {"keys": ["k"], "tokensPerMinute": 0}}}, "positive integer"),
        ({"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}, "two tenants"),
        ({"tenants": {}}, "no tenants"),
    ],
)
def test_bad_files_are_refused_naming_the_problem_but_no_key(data: object, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as err:
        TenantTable.parse(data)
    assert "'k'" not in str(err.value)


def test_concurrency_limit_gives_429_until_a_slot_is_released() -> None:
    a = TenantTable.parse(KEYS).authenticate("Bearer sk-a")
    admission = Admission(Clock())
    first, _second = admission.admit(a, 10), admission.admit(a, 10)
    with pytest.raises(Rejected) as err:
        admission.admit(a, 10)
    assert err.value.status == 429 and err.value.retry_after_s
    first.release(5)
    first.release(5)  # idempotent
    assert admission.in_flight(a) == 1
    admission.admit(a, 10)


def test_token_bucket_refills_and_refunds_unused_tokens() -> None:
    clock = Clock()
    b = TenantTable.parse(KEYS).authenticate("Bearer sk-b")  # 600 tokens/min = 10/s
    admission = Admission(clock)
    ticket = admission.admit(b, 500)
    with pytest.raises(Rejected) as err:
        admission.admit(b, 200)  # 100 left: 100 short -> 10 s
    assert err.value.status == 429 and err.value.retry_after_s == 10
    ticket.release(300)  # 200 of the 500 reserved were not used: back in the bucket
    admission.admit(b, 200).release(200)
    clock.now += 6.0  # +60 tokens
    admission.admit(b, 150)
    with pytest.raises(Rejected) as err:
        admission.admit(b, 601)
    assert err.value.status == 400  # can never fit


def test_tenants_do_not_share_limits() -> None:
    table = TenantTable.parse(KEYS)
    a, b = table.authenticate("Bearer sk-a"), table.authenticate("Bearer sk-b")
    admission = Admission(Clock())
    admission.admit(a, 1), admission.admit(a, 1)
    admission.admit(b, 1)  # team-a being full does not affect team-b
    assert admission.in_flight(b) == 1
