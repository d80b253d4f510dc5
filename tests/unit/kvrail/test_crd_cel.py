"""The CRD's CEL rules, evaluated in-process on a valid base pool plus one mutation per case.

The same manifests go to the real API server in the cluster tests; here cel-python checks the
rules' logic (after the schema's defaults are applied, as the server does).
"""

from __future__ import annotations

import pytest

from kvrail.crd.gen import openapi_schema
from kvrail.operator.testing import ACCEPTED as BASE_ACCEPTED
from kvrail.operator.testing import REFUSED as BASE_REFUSED
from kvrail.operator.testing import Change, mutate, pool_manifest
from kvrail.operator.testing_chat import CHAT_ACCEPTED, CHAT_REFUSED
from kvrail.operator.testing_gaie import GAIE_ACCEPTED, GAIE_REFUSED
from kvrail.operator.testing_tiers import TIER_ACCEPTED, TIER_REFUSED
from kvrail.testing.cel import apply_defaults, violations

REFUSED = BASE_REFUSED + TIER_REFUSED + CHAT_REFUSED + GAIE_REFUSED
ACCEPTED = BASE_ACCEPTED + TIER_ACCEPTED + CHAT_ACCEPTED + GAIE_ACCEPTED


@pytest.mark.parametrize(("case", "changes", "path", "word"), REFUSED, ids=[c[0] for c in REFUSED])
def test_rule_refuses_inconsistent_spec(
    case: str, changes: tuple[Change, ...], path: str, word: str
) -> None:
    found = violations(mutate(pool_manifest(), *changes))
    assert [v.path for v in found] == [path], found
    assert word in found[0].message


@pytest.mark.parametrize(("case", "changes"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_rules_accept_consistent_spec(case: str, changes: tuple[Change, ...]) -> None:
    assert violations(mutate(pool_manifest(), *changes)) == []


def test_defaults_fill_nested_objects_like_the_api_server() -> None:
    defaulted = apply_defaults(openapi_schema(), pool_manifest())
    assert defaulted["spec"]["decode"]["parallelism"] == {}  # tensor defaults to gpus
    assert defaulted["spec"]["topology"]["rdma"] == "preferred"
    assert defaulted["spec"]["autoscaling"]["enabled"] is False
    assert "minReplicas" not in defaulted["spec"]["decode"]
