"""CEL cases of GAIE mode (`spec.router.gateway.inferenceExtension`), in the shape of
`kvrail.operator.testing`'s `REFUSED` and `ACCEPTED` tables: for the cel-python unit tests and
the real API server tests."""

from __future__ import annotations

from typing import Any

from kvrail.operator.testing import COLOCATED, VLLM, Change


def gaie(**extension: Any) -> Change:
    """`spec.router.gateway` on the Gateway `gw` of namespace `infra`, GAIE mode on with the
    given `inferenceExtension` fields (camelCase)."""
    return (
        "spec.router.gateway",
        {
            "parentRef": {"name": "gw", "namespace": "infra"},
            "hostnames": ["llm.example.com"],
            "inferenceExtension": {"enabled": True, **extension},
        },
    )


GAIE_REFUSED: list[tuple[str, tuple[Change, ...], str, str]] = [
    (
        "GAIE mode on a vllm pool",
        (*VLLM, gaie()),
        ".spec.router.gateway.inferenceExtension.enabled",
        "engine.kind kvrail",
    ),
]

GAIE_ACCEPTED: list[tuple[str, tuple[Change, ...]]] = [
    ("GAIE mode, defaults", (gaie(),)),
    ("GAIE mode, fail open with two pickers", (gaie(failureMode="FailOpen", eppReplicas=2),)),
    ("GAIE mode on a colocated pool", (*COLOCATED, gaie(numEndpoints=1))),
    ("GAIE mode off on a vllm pool", (*VLLM, gaie(enabled=False))),
]

GAIE_SCHEMA_REFUSED: list[tuple[str, Change, str]] = [
    ("a failure mode GAIE has not", gaie(failureMode="FailSoft"),
     "spec.router.gateway.inferenceExtension.failureMode"),
    ("more pickers than allowed", gaie(eppReplicas=17),
     "spec.router.gateway.inferenceExtension.eppReplicas"),
    ("no endpoint per request", gaie(numEndpoints=0),
     "spec.router.gateway.inferenceExtension.numEndpoints"),
]  # fmt: skip
"""Manifests the schema (enum, range) refuses, as (case, change, the field named)."""
