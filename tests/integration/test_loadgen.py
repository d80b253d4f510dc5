"""bench/loadgen end to end: its command line against a real router and a real SmolLM2 worker.

One colocated worker (`--role colocated`) and one router over the session's real etcd and NATS; the
load generator runs as its own process, as a user runs it, for a handful of short streamed
requests with shared prefixes, and its JSON report is checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool

LOADGEN = Path(__file__).resolve().parents[2] / "bench" / "loadgen"
MODEL = "SmolLM2-135M-Instruct"
NUM_REQUESTS, NUM_WARMUP, MAX_TOKENS = 4, 1, 6


@pytest.fixture(scope="module")
def router_url(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    env = {"KVRAIL_DISAGGREGATION_MODE": "colocated", "KVRAIL_NUM_KV_BLOCKS": "128",
           "KVRAIL_MAX_MODEL_LEN": "512", "KVRAIL_REQUEST_TIMEOUT_S": "120"}  # fmt: skip
    pool = LocalPool(
        etcd_server, nats_server, tmp_path_factory.mktemp("loadgen-pool"),
        f"lg-{uuid.uuid4().hex[:8]}", env,
    )  # fmt: skip
    port = free_port()
    try:
        pool.start("decode-0", "colocated")
        pool.wait_ready("decode-0")
        pool.start_router("router", KVRAIL_HTTP_PORT=str(port))
        pool.wait_ready("router")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        pool.stop()


def test_the_load_generator_reports_every_request_of_a_shared_prefix_run(
    router_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "results.json"
    argv = [
        sys.executable, "-P", str(LOADGEN), "--url", router_url, "--model", MODEL,
        "--rates", "4", "--arrival", "constant", "--num-requests", str(NUM_REQUESTS),
        "--warmup", str(NUM_WARMUP), "--prompt-tokens", "4-8", "--output-tokens", f"2-{MAX_TOKENS}",
        "--shared-prefixes", "2", "--prefix-tokens", "40", "--slo-ttft-s", "600",
        "--out", str(out), "--plot", str(tmp_path / "run"), "--quiet",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "constant 4/s" in done.stdout  # the table
    report = json.loads(out.read_text())
    assert report["config"]["model"] == MODEL and report["machine"]["nproc"] >= 1
    [point] = report["points"]
    s = point["summary"]
    assert (s["num_requests"], s["num_warmup"], s["num_completed"]) == (NUM_REQUESTS, 1, 4)
    assert s["num_errors"] == 0 and s["errors"] == {}
    requests = point["requests"]
    assert [r["is_warmup"] for r in requests] == [True] + [False] * NUM_REQUESTS
    for r in requests:
        assert r["error"] is None and r["finish_reason"] in ("stop", "length")
        assert 1 <= r["output_tokens"] <= MAX_TOKENS
        # Real counts from usage: the words, plus the chat template's tokens.
        assert r["prompt_tokens"] > r["approx_prompt_tokens"] >= 44
        assert 0 < r["ttft_s"] < r["e2e_s"]
        assert r["prefix_id"] in (0, 1)
        assert r["response_id"].startswith("chatcmpl-")  # to find it in the servers' logs
    for metric in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        d = s[metric]
        assert d["count"] > 0, metric
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (metric, d)
    assert s["itl_s"]["count"] == sum(r["num_chunks"] - 1 for r in requests if not r["is_warmup"])
    assert s["requests_per_s"] > 0 and s["output_tokens_per_s"] > 0
    # Within a 600 s TTFT bound every completed request is good.
    assert s["goodput"]["num_good"] == NUM_REQUESTS
    assert s["goodput"]["requests_per_s"] == pytest.approx(s["requests_per_s"])
    assert (tmp_path / "run-latency.png").stat().st_size > 0
    assert (tmp_path / "run-goodput.png").stat().st_size > 0
