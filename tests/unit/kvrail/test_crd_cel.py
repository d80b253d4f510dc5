"""The CRD's CEL rules, evaluated in-process on a valid base pool plus one mutation per case.

The same manifests go to the real API server in the cluster tests; here cel-python checks the
rules' logic (after the schema's defaults are applied, as the server does).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvrail.crd_cel import apply_defaults, violations
from kvrail.crdgen import openapi_schema
from kvrail.operator.testing import DELETE, mutate, pool_manifest

Change = tuple[str, Any]
COLOCATED: tuple[Change, ...] = (
    ("spec.prefill", DELETE),
    ("spec.disaggregation.mode", "colocated"),
)

# (case, changes, path of the violation, a word of its message)
REFUSED: list[tuple[str, tuple[Change, ...], str, str]] = [
    (
        "replicas above max",
        (("spec.decode.replicas", 3), ("spec.decode.maxReplicas", 2)),
        ".spec.decode.replicas",
        "maxReplicas",
    ),
    (
        "min above replicas",
        (("spec.prefill.minReplicas", 2),),
        ".spec.prefill.minReplicas",
        "minReplicas",
    ),
    (
        "tensor parallel without gpus",
        (*COLOCATED, ("spec.decode.parallelism", {"tensor": 2})),
        ".spec.decode.parallelism.tensor",
        "gpus",
    ),
    (
        "gpus unequal to tensor parallel",
        (("spec.decode.gpus", 2),),
        ".spec.decode.parallelism.tensor",
        "gpus",
    ),
    (
        "batched tokens below sequences",
        (("spec.decode.maxNumBatchedTokens", 8), ("spec.decode.maxNumSeqs", 16)),
        ".spec.decode.maxNumBatchedTokens",
        "maxNumSeqs",
    ),
    (
        "prefill and decode tensor parallel differ",
        (
            ("spec.prefill.gpus", 2),
            ("spec.prefill.parallelism", {"tensor": 2}),
            ("spec.decode.gpus", 1),
        ),
        ".spec.prefill.parallelism.tensor",
        "fingerprint",
    ),
    (
        "disaggregated without prefill",
        (("spec.prefill", DELETE),),
        ".spec.prefill",
        "needs a prefill",
    ),
    (
        "colocated with prefill",
        (("spec.disaggregation.mode", "colocated"),),
        ".spec.prefill",
        "remove prefill",
    ),
    (
        "threshold at max model length",
        (("spec.disaggregation.minRemotePrefillTokens", 4096),),
        ".spec.disaggregation.minRemotePrefillTokens",
        "maxModelLen",
    ),
    (
        "rdma resource without rdma required",
        (("spec.topology.rdmaResource", "rdma/hca"),),
        ".spec.topology.rdmaResource",
        "required",
    ),
    (
        "rdma required with the local backend",
        (("spec.topology.rdma", "required"), ("spec.disaggregation.transferBackend", "local")),
        ".spec.topology.rdma",
        "local",
    ),
    (
        "autoscaling without max replicas",
        (("spec.autoscaling.enabled", True), ("spec.decode.maxReplicas", 4)),
        ".spec.autoscaling.enabled",
        "maxReplicas",
    ),
    ("vllm engine", (("spec.engine.kind", "vllm"),), ".spec.engine", "reserved"),
    ("pool name too long", (("metadata.name", "p" * 41),), "", "40"),
    ("pool name starting with a digit", (("metadata.name", "8b"),), "", "DNS-1035"),
    ("pool name with a dot", (("metadata.name", "a.b"),), "", "DNS-1035"),
]

ACCEPTED: list[tuple[str, tuple[Change, ...]]] = [
    ("the base pool", ()),
    ("colocated without prefill", COLOCATED),
    (
        "colocated threshold may exceed max length",
        (*COLOCATED, ("spec.disaggregation.minRemotePrefillTokens", 10**6)),
    ),
    (
        "replicas within min and max",
        (
            ("spec.decode.minReplicas", 1),
            ("spec.decode.replicas", 2),
            ("spec.decode.maxReplicas", 3),
        ),
    ),
    ("prefill scaled to zero", (("spec.prefill.replicas", 0), ("spec.prefill.minReplicas", 0))),
    (
        "eight-GPU tensor parallel on both pools",
        (
            ("spec.prefill.gpus", 8),
            ("spec.prefill.parallelism", {"tensor": 8}),
            ("spec.decode.gpus", 8),
            ("spec.decode.parallelism", {"tensor": 8}),
        ),
    ),
    (
        "rdma required with a device resource",
        (("spec.topology.rdma", "required"), ("spec.topology.rdmaResource", "rdma/hca")),
    ),
    (
        "local backend without rdma",
        (("spec.topology.rdma", "none"), ("spec.disaggregation.transferBackend", "local")),
    ),
    (
        "autoscaling with max replicas on both pools",
        (
            ("spec.autoscaling.enabled", True),
            ("spec.decode.maxReplicas", 4),
            ("spec.prefill.maxReplicas", 2),
        ),
    ),
    ("a 40-character name", (("metadata.name", "p" * 40),)),
]


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
    assert defaulted["spec"]["decode"]["parallelism"] == {"tensor": 1}
    assert defaulted["spec"]["topology"]["rdma"] == "preferred"
    assert defaulted["spec"]["autoscaling"]["enabled"] is False
    assert "minReplicas" not in defaulted["spec"]["decode"]
