"""What the sweep observes besides the client's figures: the workers' logs (prefill mode, TTFT
stages, transfers) and the machine (GPU memory, software versions). Loaded by `run.py`."""

from __future__ import annotations

import importlib
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kvrail.testing.scripts import load_script

lg = load_script(
    "kvrail_bench_loadgen", Path(__file__).resolve().parents[1] / "loadgen" / "__init__.py"
)


_FIRST = re.compile(r"first token request_id=(\S+) mode=(\S+) prompt_tokens=(\d+) ?(.*)$")
_WRITTEN = re.compile(
    r"prefill written request_id=(\S+) .*transfer_s=([0-9.]+) transport=(\S+) compute_s=([0-9.]+)"
)


def parse_worker_log(text: str) -> dict[str, dict[str, Any]]:
    """Request id -> what a worker logged about it: the decode side's `first token` line (mode,
    TTFT stages in seconds) and the prefill side's `prefill written` line (transfer, compute)."""
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        if m := _FIRST.search(line):
            stages = dict(kv.split("=", 1) for kv in m[4].split() if "=" in kv)
            entry = out.setdefault(m[1], {})
            entry["mode"] = m[2]
            entry.update({k: float(v) for k, v in stages.items()})
        elif m := _WRITTEN.search(line):
            entry = out.setdefault(m[1].split("~", 1)[0], {})
            entry.update(
                transfer_s=float(m[2]), transport=m[3], prefill_compute_s_remote=float(m[4])
            )
    return out


def server_summary(
    records: list[dict[str, Any]], logged: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The workers' view of a point's measured requests: prefill modes, transports, which worker
    decoded them (where known), and p50/p99 of each logged stage."""
    measured = [r for r in records if not r["is_warmup"] and r["response_id"] in logged]
    mine = [logged[r["response_id"]] for r in measured]
    # The client's TTFT less the decode worker's time with the request: the router, NATS and
    # the client, one request at a time (p50s of the two would not subtract).
    outside = [
        r["ttft_s"] - seen["in_worker_s"]
        for r in measured
        if r.get("ttft_s") is not None and "in_worker_s" in (seen := logged[r["response_id"]])
    ]
    modes: dict[str, int] = {}
    transports: dict[str, int] = {}
    decoded_by: dict[str, int] = {}
    for e in mine:
        if "decode_worker" in e:
            decoded_by[e["decode_worker"]] = decoded_by.get(e["decode_worker"], 0) + 1
        if "mode" in e:
            modes[e["mode"]] = modes.get(e["mode"], 0) + 1
        if "transport" in e:
            transports[e["transport"]] = transports.get(e["transport"], 0) + 1
    keys = sorted({k for e in mine for k, v in e.items() if isinstance(v, float)})
    stages = {}
    for k in keys:
        values = [e[k] for e in mine if k in e]
        stages[k] = {"p50": lg.percentile(values, 50), "p99": lg.percentile(values, 99)}
    if outside:
        stages["outside_worker_s"] = {
            "p50": lg.percentile(outside, 50), "p99": lg.percentile(outside, 99),
        }  # fmt: skip
    return {"num_logged": len(mine), "prefill_modes": modes, "transports": transports,
            "decoded_by": decoded_by, "stages_s": stages}  # fmt: skip


def gpu_memory() -> dict[str, Any] | None:
    """nvidia-smi's view: the GPUs' used/total MiB (summed; `per_gpu` has each one's) and each
    process's MiB (None without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None

    def query(*args: str) -> list[list[str]]:
        done = subprocess.run([smi, *args, "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
        return [[c.strip() for c in line.split(",")] for line in done.stdout.splitlines() if line]

    gpus = query("--query-gpu=index,name,memory.used,memory.total,driver_version")
    if not gpus:
        return None
    apps = query("--query-compute-apps=pid,used_memory")
    out = {"gpu": gpus[0][1], "driver": gpus[0][4], "num_gpus": len(gpus),
           "used_mib": sum(int(g[2]) for g in gpus), "total_mib": sum(int(g[3]) for g in gpus),
           "processes_mib": {pid: int(mib) for pid, mib in apps}}  # fmt: skip
    if len(gpus) > 1:
        out["per_gpu"] = {g[0]: {"used_mib": int(g[2]), "total_mib": int(g[3])} for g in gpus}
    return out


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "nixl", "openai"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        out[name] = getattr(module, "__version__", "?")
    try:
        import torch

        out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out
