"""RDMA-aware placement: affinity, spread, hardware resources and UCX transports, per spec."""

from __future__ import annotations

from typing import Any

import pytest

from kvrail.crd.pool import InferencePool
from kvrail.operator.builders import placement
from kvrail.operator.testing import DELETE, make_pool, mutate, pool_manifest

RDMA_LABEL = "feature.node.kubernetes.io/rdma.capable"


def pool_with(*changes: tuple[str, Any]) -> InferencePool:
    return make_pool(mutate(pool_manifest(), *changes))


def test_rdma_required_is_a_required_node_affinity_on_the_label() -> None:
    node = placement.affinity(pool_with(("spec.topology.rdma", "required")), "decode")[
        "nodeAffinity"
    ]
    terms = node["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [
        {"matchExpressions": [{"key": RDMA_LABEL, "operator": "In", "values": ["true"]}]}
    ]
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in node


def test_rdma_preferred_is_a_weighted_preference() -> None:
    node = placement.affinity(pool_with(("spec.topology.rdma", "preferred")), "prefill")[
        "nodeAffinity"
    ]
    (pref,) = node["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["weight"] == placement.NODE_AFFINITY_WEIGHT
    assert pref["preference"]["matchExpressions"][0]["key"] == RDMA_LABEL
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in node


def test_rdma_none_adds_no_node_affinity() -> None:
    assert "nodeAffinity" not in placement.affinity(
        pool_with(("spec.topology.rdma", "none")), "decode"
    )


def test_custom_rdma_label_and_value_are_used() -> None:
    pool = pool_with(
        ("spec.topology.rdma", "required"),
        ("spec.topology.rdmaNodeLabel", "example.com/ib"),
        ("spec.topology.rdmaNodeLabelValue", "hdr"),
    )
    node = placement.affinity(pool, "decode")["nodeAffinity"]
    expr = node["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert expr["matchExpressions"] == [
        {"key": "example.com/ib", "operator": "In", "values": ["hdr"]}
    ]


@pytest.mark.parametrize(("role", "peer"), [("prefill", "decode"), ("decode", "prefill")])
def test_each_role_prefers_the_colocation_domain_of_the_other(role: str, peer: str) -> None:
    pool = pool_with(("spec.topology.colocationKey", "example.com/rack"))
    (term,) = placement.affinity(pool, role)["podAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]  # type: ignore[arg-type]
    assert term["weight"] == placement.COLOCATION_WEIGHT
    assert term["podAffinityTerm"]["topologyKey"] == "example.com/rack"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == {
        "kvrail.dev/pool": "tiny",
        "kvrail.dev/role": peer,
    }


def test_colocated_pool_has_no_pod_affinity() -> None:
    pool = pool_with(("spec.prefill", DELETE), ("spec.disaggregation.mode", "colocated"))
    assert "podAffinity" not in placement.affinity(pool, "decode")


def test_same_role_replicas_spread_best_effort_over_the_spread_key() -> None:
    (spread,) = placement.topology_spread(pool_with(("spec.topology.spreadKey", "zone")), "prefill")
    assert spread["topologyKey"] == "zone"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"]["matchLabels"]["kvrail.dev/role"] == "prefill"


RESOURCES: list[tuple[str, tuple[tuple[str, Any], ...], dict[str, Any]]] = [
    ("cpu pool asks for nothing extra", (), {}),
    (
        "role cpu and memory pass through",
        (("spec.decode.resources", {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}}),),
        {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}},
    ),
    (
        "gpus are requested and limited",
        (("spec.decode.gpus", 1),),
        {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}},
    ),
    (
        "rdma device is requested when required",
        (
            ("spec.topology.rdma", "required"),
            ("spec.topology.rdmaResource", "rdma/ib"),
            ("spec.topology.rdmaResourceCount", 2),
        ),
        {"requests": {"rdma/ib": 2}, "limits": {"rdma/ib": 2}},
    ),
    (
        "other gpu resource name",
        (
            ("spec.decode.gpus", 2),
            ("spec.decode.parallelism", {"tensor": 2}),
            ("spec.decode.gpuResource", "amd.com/gpu"),
        ),
        {"requests": {"amd.com/gpu": 2}, "limits": {"amd.com/gpu": 2}},
    ),
]


@pytest.mark.parametrize(("case", "changes", "expected"), RESOURCES, ids=[c[0] for c in RESOURCES])
def test_worker_resources(
    case: str, changes: tuple[tuple[str, Any], ...], expected: dict[str, Any]
) -> None:
    pool = pool_with(*changes)
    assert placement.resources(pool, pool.spec.decode) == expected


def test_gpu_pool_tolerates_the_gpu_taint_once() -> None:
    pool = pool_with(("spec.decode.gpus", 1))
    assert placement.tolerations(pool.spec.decode) == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    own = pool_with(
        ("spec.decode.gpus", 1),
        ("spec.decode.tolerations", [{"key": "nvidia.com/gpu", "operator": "Exists"}]),
    )
    assert placement.tolerations(own.spec.decode) == [
        {"key": "nvidia.com/gpu", "operator": "Exists"}
    ]
    assert placement.tolerations(make_pool().spec.decode) == []


UCX: list[tuple[str, int, str]] = [
    ("required", 0, "rc,ud,sm,self"),
    ("preferred", 0, "rc,ud,tcp,sm,self"),
    ("none", 0, "tcp,sm,self"),
    ("required", 1, "rc,ud,sm,self,cuda_copy,cuda_ipc"),
]


@pytest.mark.parametrize(("rdma", "gpus", "expected"), UCX)
def test_ucx_transports_never_include_tcp_when_rdma_is_required(
    rdma: str, gpus: int, expected: str
) -> None:
    pool = pool_with(("spec.topology.rdma", rdma), ("spec.decode.gpus", gpus))
    assert placement.ucx_tls(pool, pool.spec.decode) == expected


def test_rdma_workers_add_only_ipc_lock() -> None:
    assert placement.capabilities(pool_with(("spec.topology.rdma", "preferred"))) == ["IPC_LOCK"]
    assert placement.capabilities(pool_with(("spec.topology.rdma", "none"))) == []
