"""CEL cases of a role's KV tiers (`kvTiers`), in the shape of `kvrail.operator.testing`'s
`REFUSED` and `ACCEPTED` tables: for the cel-python unit tests and the real API server tests.

Every size here matches the schema's pattern, so what refuses a case is a CEL rule (a pattern
violation is the schema's, tested with the models).
"""

from __future__ import annotations

from typing import Any

from kvrail.operator.testing import COLOCATED, VLLM, Change

HOST_64GI: dict[str, Any] = {"host": {"size": "64Gi"}}
HOST_AND_DISK: dict[str, Any] = {
    "host": {"size": "64Gi"},
    "disk": {"path": "/var/lib/kvrail/kv", "size": "500Gi"},
}
"""A host tier of 64 GiB and a disk tier of 500 GiB on NVMe."""


def _disk(path: str = "/var/lib/kvrail/kv", size: str = "500Gi") -> dict[str, Any]:
    return {"host": {"size": "64Gi"}, "disk": {"path": path, "size": size}}


TIER_REFUSED: list[tuple[str, tuple[Change, ...], str, str]] = [
    (
        "a host tier above 16Ti",
        (("spec.decode.kvTiers", {"host": {"size": "17Ti"}}),),
        ".spec.decode.kvTiers.host.size",
        "1Mi to 16Ti",
    ),
    (
        "a disk tier above 1Pi",
        (("spec.prefill.kvTiers", _disk(size="1025Ti")),),
        ".spec.prefill.kvTiers.disk.size",
        "1Mi to 1Pi",
    ),
    (
        "a host tier of a few bytes",
        (("spec.decode.kvTiers", {"host": {"size": "512"}}),),
        ".spec.decode.kvTiers.host.size",
        "0 (off)",
    ),
    (
        "vllm with a host tier in a disaggregated pool",
        (*VLLM, ("spec.decode.kvTiers", HOST_64GI)),
        ".spec.decode.kvTiers.host",
        "colocated",
    ),
    (
        "kvrail's engine with tiers on two gpus",
        (("spec.prefill.gpus", 2), ("spec.decode.gpus", 2), ("spec.decode.kvTiers", HOST_64GI)),
        ".spec.decode.kvTiers.host",
        "one GPU",
    ),
    (
        "a disk tier without a host tier",
        (("spec.decode.kvTiers", {"disk": _disk()["disk"]}),),
        ".spec.decode.kvTiers.disk",
        "host tier",
    ),
    (
        "a disk tier over a host tier of 0",
        (("spec.decode.kvTiers", {**_disk(), "host": {"size": "0"}}),),
        ".spec.decode.kvTiers.disk",
        "host tier",
    ),
    (
        "a disk path with ..",
        (("spec.decode.kvTiers", _disk(path="/var/lib/../kv")),),
        ".spec.decode.kvTiers.disk.path",
        "normalised",
    ),
    (
        "a disk path with //",
        (("spec.decode.kvTiers", _disk(path="/var//kv")),),
        ".spec.decode.kvTiers.disk.path",
        "normalised",
    ),
    (
        "a disk path under /tmp",
        (("spec.decode.kvTiers", _disk(path="/tmp/kv")),),
        ".spec.decode.kvTiers.disk.path",
        "mounts already",
    ),
    (
        "a disk path on the weights",
        (("spec.decode.kvTiers", _disk(path="/models")),),
        ".spec.decode.kvTiers.disk.path",
        "mounts already",
    ),
    (
        "vllm with a disk tier",
        (*VLLM, *COLOCATED, ("spec.decode.kvTiers", HOST_AND_DISK)),
        ".spec.decode.kvTiers.disk",
        "no disk KV tier",
    ),
    (
        "vllm with a disk tier on prefill",
        (*VLLM, ("spec.prefill.kvTiers", {"disk": {"path": "/nvme/kv", "size": "0"}})),
        ".spec.prefill.kvTiers.disk",
        "no disk KV tier",
    ),
]

TIER_ACCEPTED: list[tuple[str, tuple[Change, ...]]] = [
    ("a host tier on decode", (("spec.decode.kvTiers", HOST_64GI),)),
    ("host and disk tiers on both pools",
     (("spec.decode.kvTiers", HOST_AND_DISK), ("spec.prefill.kvTiers", HOST_AND_DISK))),
    ("a host tier of exactly 16Ti", (("spec.decode.kvTiers", {"host": {"size": "16Ti"}}),)),
    ("a host tier in decimal bytes", (("spec.decode.kvTiers", {"host": {"size": "1.5G"}}),)),
    ("a host tier of 0 (off)", (("spec.decode.kvTiers", {"host": {"size": "0"}}),)),
    ("a disk tier of 0 (off) without a host tier",
     (("spec.decode.kvTiers", {"disk": {"path": "/nvme/kv", "size": "0"}}),)),
    ("a disk tier of exactly 1Pi", (("spec.decode.kvTiers", _disk(size="1Pi")),)),
    ("a disk path like /tmpfs (not under /tmp)", (("spec.decode.kvTiers", _disk(path="/tmpfs")),)),
    ("a colocated pool with tiers", (*COLOCATED, ("spec.decode.kvTiers", HOST_AND_DISK))),
    ("tiers on one gpu", (("spec.prefill.gpus", 1), ("spec.decode.gpus", 1),
                          ("spec.decode.kvTiers", HOST_AND_DISK))),
    ("colocated vllm with a host tier on two gpus",
     (*VLLM, *COLOCATED, ("spec.decode.gpus", 2), ("spec.decode.kvTiers", HOST_64GI))),
    ("colocated vllm with a host tier", (*VLLM, *COLOCATED, ("spec.decode.kvTiers", HOST_64GI))),
]  # fmt: skip
