"""The RDMA requirement check (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrail.worker.transfer.rdma import rdma_devices, rdma_problem


@pytest.mark.parametrize("mode", ["preferred", "none"])
def test_only_required_can_keep_a_worker_unready(mode: str) -> None:
    assert rdma_problem(mode, {}, []) is None


@pytest.mark.parametrize(
    ("environ", "devices", "problem"),
    [
        ({"UCX_TLS": "rc,ud,sm,self"}, [], "no RDMA device"),
        ({}, ["mlx5_0"], "UCX_TLS is unset"),
        ({"UCX_TLS": "sm,self,tcp"}, ["mlx5_0"], "names no RDMA transport"),
        ({"UCX_TLS": "rc,ud,tcp"}, ["mlx5_0"], "allows TCP"),
        ({"UCX_TLS": "rc,ud,sm,self,cuda_ipc"}, ["mlx5_0"], None),
    ],
)
def test_required_needs_a_device_and_rdma_only_transports(
    environ: dict[str, str], devices: list[str], problem: str | None
) -> None:
    found = rdma_problem("required", environ, devices)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_devices_are_read_from_the_infiniband_class(tmp_path: Path) -> None:
    assert rdma_devices(tmp_path / "absent") == []
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert rdma_devices(tmp_path) == ["mlx5_0", "mlx5_1"]
