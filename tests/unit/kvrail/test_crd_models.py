"""The InferencePool models: defaults, camelCase aliases and structural validation."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from pydantic import ValidationError

from kvrail.crd.chat import ReasoningParser, ToolCallParser
from kvrail.crd.pool import InferencePool
from kvrail.operator.testing import DELETE, Change, make_pool, mutate, pool_manifest
from kvrail.operator.testing_chat import CHAT_SCHEMA_REFUSED, template
from kvrail.operator.testing_gaie import GAIE_SCHEMA_REFUSED
from kvrail.settings import Settings


def test_minimal_manifest_gets_documented_defaults() -> None:
    pool = make_pool()
    assert pool.spec.model.block_size == 16
    assert pool.spec.model.kv_dtype == "auto"
    assert pool.spec.engine.kind == "kvrail"
    assert pool.spec.engine.image is None
    assert pool.spec.engine.extra_args == []
    assert pool.spec.decode.replicas == 1
    assert pool.spec.disaggregation.mode == "disaggregated"
    assert pool.spec.disaggregation.kv_load_failure_policy == "recompute"
    assert pool.spec.topology.rdma == "preferred"
    assert pool.spec.router.policy == "kv-aware"
    assert pool.spec.router.scorers == []
    assert pool.spec.autoscaling.enabled is False
    assert pool.status is None


def test_fields_are_camel_case_in_yaml_and_round_trip() -> None:
    manifest = mutate(pool_manifest(), ("spec.disaggregation.minRemotePrefillTokens", 64))
    pool = make_pool(manifest)
    assert pool.spec.disaggregation.min_remote_prefill_tokens == 64
    dumped = pool.model_dump(mode="json", exclude_none=True)
    assert dumped["spec"]["disaggregation"]["minRemotePrefillTokens"] == 64
    assert "min_remote_prefill_tokens" not in dumped["spec"]["disaggregation"]
    assert InferencePool.model_validate(dumped) == pool


def test_role_returns_none_for_a_colocated_pool_without_prefill() -> None:
    manifest = mutate(
        pool_manifest(), ("spec.prefill", DELETE), ("spec.disaggregation.mode", "colocated")
    )
    pool = make_pool(manifest)
    assert pool.role("prefill") is None
    assert pool.role("decode") is pool.spec.decode


INVALID: list[tuple[str, tuple[str, Any], str]] = [
    ("unknown field", ("spec.decode.replica", 2), "extra"),
    ("negative replicas", ("spec.decode.replicas", -1), "greater than or equal"),
    ("dtype outside the enum", ("spec.model.dtype", "int8"), "dtype"),
    ("block size outside the enum", ("spec.model.blockSize", 12), "blockSize"),
    ("kv utilization over 100", ("spec.autoscaling.decodeKvUtilizationTarget", 101), "100"),
    ("bad failure policy", ("spec.disaggregation.kvLoadFailurePolicy", "retry"), "recompute"),
    ("rdma mode outside the enum", ("spec.topology.rdma", "maybe"), "required"),
    ("router policy outside the enum", ("spec.router.policy", "random"), "kv-aware"),
    ("unknown scorer", ("spec.router.scorers", [{"name": "queue", "weight": 1}]), "prefix-cache"),
    (
        "negative scorer weight",
        ("spec.router.scorers", [{"name": "load", "weight": -1}]),
        "greater than or equal",
    ),
    (
        "etcd endpoint without a port",
        ("spec.infrastructure.etcd", {"endpoints": ["http://e"]}),
        "pattern",
    ),
    (
        "nats url with a bad scheme",
        ("spec.infrastructure.nats", {"url": "http://n:4222"}),
        "pattern",
    ),
    (
        "hostname with upper case",
        ("spec.router.gateway", {"parentRef": {"name": "gw"}, "hostnames": ["A.b"]}),
        "pattern",
    ),
    ("engine kind outside the enum", ("spec.engine.kind", "sglang"), "kvrail"),
    ("too many engine arguments", ("spec.engine.extraArgs", ["-x"] * 65), "64"),
    ("an engine argument too long", ("spec.engine.extraArgs", ["x" * 1025]), "1024"),
    ("an empty engine image", ("spec.engine.image", ""), "at least 1"),
    (
        "gateway without parentRef",
        ("spec.router.gateway", {"hostnames": ["a.example"]}),
        "parentRef",
    ),
]


@pytest.mark.parametrize(("case", "change", "expected"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_field_is_refused_by_the_model(
    case: str, change: tuple[str, Any], expected: str
) -> None:
    with pytest.raises(ValidationError, match=expected):
        make_pool(mutate(pool_manifest(), change))


SCHEMA_REFUSED = CHAT_SCHEMA_REFUSED + GAIE_SCHEMA_REFUSED


@pytest.mark.parametrize(
    ("case", "change", "field"), SCHEMA_REFUSED, ids=[c[0] for c in SCHEMA_REFUSED]
)
def test_model_refuses_fields_the_schema_refuses_naming_the_field(
    case: str, change: Change, field: str
) -> None:
    with pytest.raises(ValidationError) as err:
        make_pool(mutate(pool_manifest(), change))
    locations = [".".join(map(str, e["loc"])) for e in err.value.errors()]
    assert locations[0].startswith(field), locations


def test_chat_fields_default_to_the_routers_own_detection() -> None:
    model = make_pool().spec.model
    assert (model.chat_template, model.tool_call_parser, model.reasoning_parser) == (
        None, "auto", "auto",
    )  # fmt: skip
    ref = make_pool(mutate(pool_manifest(), template())).spec.model.chat_template
    assert ref is not None
    assert (ref.config_map_key_ref.name, ref.config_map_key_ref.key) == (
        "agents-template", "chat_template.jinja",
    )  # fmt: skip


def test_the_crds_parsers_are_the_routers_settings() -> None:
    """The operator writes these fields into the router's settings verbatim: the enums agree."""
    for name, crd in (("tool_call_parser", ToolCallParser), ("reasoning_parser", ReasoningParser)):
        assert get_args(Settings.model_fields[name].annotation) == get_args(crd), name


def test_kv_tiers_default_to_none_and_read_their_sizes_as_bytes() -> None:
    assert make_pool().spec.decode.kv_tiers.host_bytes == 0
    tiers = {"host": {"size": "1.5Gi"}, "disk": {"path": "/nvme/kv", "size": "500G"}}
    pool = make_pool(mutate(pool_manifest(), ("spec.decode.kvTiers", tiers)))
    assert pool.spec.decode.kv_tiers.host_bytes == 3 * 2**29
    assert pool.spec.decode.kv_tiers.disk_bytes == 500 * 10**9
    assert pool.spec.prefill is not None and pool.spec.prefill.kv_tiers.disk is None


@pytest.mark.parametrize(
    ("tiers", "word"),
    [
        ({"host": {"size": "-1Gi"}}, "pattern"),
        ({"host": {"size": "500m"}}, "pattern"),
        ({"host": {"size": "1e9"}}, "pattern"),
        ({"host": {"size": "17Ti"}}, "1Mi to 16Ti"),
        ({"host": {"size": "1Ki"}}, "1Mi to 16Ti"),
        ({"host": {"size": "1Gi"}, "disk": {"path": "kv", "size": "1Gi"}}, "pattern"),
        ({"host": {"size": "1Gi"}, "disk": {"path": "/a/./b", "size": "1Gi"}}, "normalised"),
        ({"host": {"size": "1Gi"}, "disk": {"path": "/dev/shm/kv", "size": "1Gi"}}, "mounts"),
        ({"disk": {"path": "/nvme/kv", "size": "1Gi"}}, "host tier"),
        ({"host": {"size": "0"}, "disk": {"path": "/nvme/kv", "size": "1Gi"}}, "host tier"),
    ],
)
def test_models_refuse_kv_tiers_the_crd_refuses(tiers: dict[str, Any], word: str) -> None:
    with pytest.raises(ValidationError, match=word):
        make_pool(mutate(pool_manifest(), ("spec.decode.kvTiers", tiers)))
