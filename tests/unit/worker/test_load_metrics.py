"""A worker's load gauges: a real engine's counts, through `report_load`, read back from the
worker's registry with prometheus_client's text parser, as an endpoint picker scrapes them.

vLLM's names (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`) carry the same values as kvrail's own gauges, with vLLM's meaning
for the KV fraction: cached blocks no request references count as free. kvrail's own reader of a
vLLM server's gauges (the vLLM-pool agent's `parse_metrics`, checked against real vLLM by its live
test) reads a kvrail worker's load back the same."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrail import metrics as names
from kvrail.agent.vllm import parse_metrics
from kvrail.sampling import SamplingParams
from kvrail.worker import metrics
from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

MODEL = "served-name-under-test"
PROMPT = list(range(3, 24))  # 21 tokens: 6 blocks of 4 with the first new token


def exposition() -> str:
    return generate_latest(metrics.REGISTRY).decode()


def scrape(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every gauge sample of an exposition: name -> (sorted labels) -> value."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def load(engine: object) -> tuple[float, float, float]:
    """Report the engine's counts as the worker's refresh does; vLLM's three values back."""
    c = engine.counts()  # type: ignore[attr-defined]
    usage = metrics.kv_cache_usage(c.num_free_blocks, c.num_blocks)
    metrics.report_load(MODEL, c.num_running, c.num_waiting, usage)
    text = exposition()
    samples = scrape(text)
    label = (("model_name", MODEL),)
    vllm = tuple(
        samples[name][label]
        for name in (
            names.VLLM_NUM_REQUESTS_RUNNING,
            names.VLLM_NUM_REQUESTS_WAITING,
            names.VLLM_KV_CACHE_USAGE_PERC,
        )
    )
    twins = tuple(
        samples[name][()]
        for name in (names.RUNNING_REQUESTS, names.WAITING_REQUESTS, names.KV_CACHE_UTILIZATION)
    )
    assert vllm == twins, "vLLM's gauges and kvrail's disagree"
    assert vllm == (c.num_running, c.num_waiting, pytest.approx(usage))
    read = parse_metrics(text, MODEL)
    assert (read.num_running, read.num_waiting, read.kv_utilization) == vllm
    return vllm  # type: ignore[return-value]


def test_kv_cache_usage_is_the_fraction_of_blocks_requests_hold() -> None:
    assert metrics.kv_cache_usage(96, 96) == 0.0
    assert metrics.kv_cache_usage(24, 96) == 0.75
    assert metrics.kv_cache_usage(0, 96) == 1.0


def test_an_engines_counts_become_vllms_gauges_and_kvrails_alike() -> None:
    engine = make_engine(tiny_llama_config(), seed=1, max_num_seqs=1, num_blocks=33)
    assert load(engine) == (0, 0, 0.0)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("first", PROMPT, params)
    engine.add_request("second", [7, 8, 9], params)
    assert load(engine) == (0, 2, 0.0)  # queued, no blocks yet
    engine.step()
    running, waiting, usage = load(engine)
    assert (running, waiting) == (1, 1)  # one sequence at a time
    assert usage == pytest.approx(6 / 32)  # 32 blocks besides the null block
    while engine.has_unfinished_requests():
        engine.step()
    # The finished requests' blocks stay cached for prefix reuse, yet count as free.
    assert engine.scheduler.kv_cache_manager.block_pool.counts()[1] > 0
    assert load(engine) == (0, 0, 0.0)
    assert_engine_empty(engine)
