"""bench/serving/tiers.py end to end on the CPU: its own etcd, NATS, a real SmolLM2 colocated
worker with a host tier and the router, two short multi-turn sessions through the real `openai`
client, and the JSON it writes checked against itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TIERS = Path(__file__).resolve().parents[2] / "bench" / "serving" / "tiers.py"


def test_the_tier_benchmark_reuses_each_sessions_earlier_turns(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    argv = [
        sys.executable, "-P", str(TIERS), "--cpu-smoke", "--setups", "kvrail-host",
        "--sessions", "2", "--turns", "2", "--concurrency", "2", "--warmup-sessions", "0",
        "--work", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    [setup] = result["setups"]
    assert setup["setup"] == "kvrail-host"
    assert setup["worker_env"]["KVRAIL_KV_HOST_TIER_BYTES"] == str(1 << 28)
    [point] = setup["points"]
    turns = {(t["session"], t["turn"]): t for t in point["turns"]}
    assert sorted(turns) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(t["error"] is None and t["output_tokens"] == 8 for t in turns.values())
    for session in (0, 1):
        first, second = turns[(session, 0)], turns[(session, 1)]
        # the second prompt holds the first prompt and its answer; two sessions fit the pool,
        # so at least the first prompt's full blocks come from the prefix cache
        assert second["prompt_tokens"] > first["prompt_tokens"] + 8
        assert second["cached_tokens"] >= first["prompt_tokens"] // 16 * 16
    summary = point["summary"]
    total = sum(t["prompt_tokens"] for t in turns.values())
    cached = sum(t["cached_tokens"] for t in turns.values())
    assert summary["prompt_tokens_total"] == total
    assert summary["prompt_tokens_computed"] == total - cached
    finals = turns[(0, 1)]["prompt_tokens"] + turns[(1, 1)]["prompt_tokens"]
    assert summary["live_prefix_ratio"] == finals / result["pool_tokens"]
    assert "kvrail_kv_cache_utilization_ratio" in point["metrics_after"]
    assert "| kvrail-host | concurrency 2 |" in done.stdout
