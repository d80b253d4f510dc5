"""The `vllm serve` command line and environment per role and mode, and the dtype and policy words
kvrail maps to vLLM's."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kvrail.vllm.serve import (
    NIXL_SIDE_CHANNEL_PORT,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_PORT_ENV,
    VLLM_PORT,
    ServeConfig,
    kv_cache_dtype,
    kv_offloading_size,
    kv_transfer_config,
    serve_argv,
    serve_env,
    serve_flags,
    served_model_name,
)

BASE = ServeConfig(
    model="/models/llama",
    served_model_name="llama",
    role="decode",
    dtype="bfloat16",
    kv_dtype="auto",
    block_size=16,
    max_model_len=8192,
    max_num_seqs=128,
    max_num_batched_tokens=4096,
)


def config(**changes: Any) -> ServeConfig:
    return dataclasses.replace(BASE, **changes)


def flag(argv: list[str], name: str) -> str | None:
    """The value after `name`, or None when the flag is absent (it must not repeat)."""
    found = [argv[i + 1] for i, arg in enumerate(argv) if arg == name]
    assert len(found) <= 1, (name, argv)
    return found[0] if found else None


def transfer(argv: list[str]) -> dict[str, Any] | None:
    text = flag(argv, "--kv-transfer-config")
    return None if text is None else json.loads(text)  # type: ignore[no-any-return]


def test_argv_serves_the_model_under_its_name_with_the_pools_limits() -> None:
    argv = serve_argv(config(tensor_parallel_size=2))
    assert argv[:3] == ["vllm", "serve", "/models/llama"]
    assert flag(argv, "--served-model-name") == "llama"
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("0.0.0.0", str(VLLM_PORT))
    assert flag(argv, "--block-size") == "16"
    assert flag(argv, "--max-model-len") == "8192"
    assert flag(argv, "--max-num-seqs") == "128"
    assert flag(argv, "--max-num-batched-tokens") == "4096"
    assert flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert all(isinstance(a, str) for a in argv)


@pytest.mark.parametrize(
    ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_prefill_produces_and_decode_consumes_kv_through_the_nixl_connector(
    role: str, kv_role: str
) -> None:
    argv = serve_argv(config(role=role))
    assert transfer(argv) == {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
    }
    compact = (
        '{"kv_connector":"NixlConnector","kv_role":"ROLE","kv_load_failure_policy":"recompute"}'
    )
    assert flag(argv, "--kv-transfer-config") == compact.replace("ROLE", kv_role)


def test_prefill_and_decode_differ_only_in_their_limits_and_kv_role() -> None:
    prefill = serve_argv(config(role="prefill", max_num_batched_tokens=16384))
    decode = serve_argv(config(role="decode", max_num_batched_tokens=16384))
    differ = [(p, d) for p, d in zip(prefill, decode, strict=True) if p != d]
    assert len(differ) == 1
    assert transfer(prefill)["kv_role"] == "kv_producer"  # type: ignore[index]


def test_flags_are_the_same_for_vllm_serve_and_the_api_server_module() -> None:
    cfg = config(role="decode", extra_args=("--enforce-eager",))
    assert serve_argv(cfg) == ["vllm", "serve", cfg.model, *serve_flags(cfg)]
    assert serve_flags(cfg)[-1] == "--enforce-eager"


def test_colocated_server_has_no_connector_and_no_side_channel() -> None:
    cfg = config(role="colocated", side_channel_host="10.0.0.1")
    assert transfer(serve_argv(cfg)) is None
    assert kv_transfer_config(cfg) is None
    assert serve_env(cfg) == {}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failure_policy_is_passed_to_vllm_as_is(policy: str) -> None:
    got = transfer(serve_argv(config(kv_load_failure_policy=policy)))
    assert got is not None
    assert got["kv_load_failure_policy"] == policy


def test_reroute_is_refused_naming_what_vllm_knows() -> None:
    with pytest.raises(ValueError, match="only recompute and fail, not 'reroute'"):
        config(kv_load_failure_policy="reroute")


def test_cpu_worker_buffers_kv_on_the_cpu() -> None:
    got = transfer(serve_argv(config(kv_buffer_device="cpu")))
    assert got is not None
    assert got["kv_buffer_device"] == "cpu"
    gpu = transfer(serve_argv(BASE))
    assert gpu is not None
    assert "kv_buffer_device" not in gpu  # vLLM's default, cuda
    assert "--device" not in serve_argv(config(kv_buffer_device="cpu"))


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "expected"),
    [
        ("bfloat16", "auto", None),
        ("bfloat16", "bfloat16", None),
        ("float16", "float16", None),
        ("float32", "float32", None),
        ("bfloat16", "float8_e4m3fn", "fp8_e4m3"),
        ("float16", "float8_e5m2", "fp8_e5m2"),
    ],
)
def test_kv_dtype_maps_to_vllms_cache_dtype(dtype: str, kv_dtype: str, expected: str) -> None:
    assert kv_cache_dtype(dtype, kv_dtype) == expected
    argv = serve_argv(config(dtype=dtype, kv_dtype=kv_dtype))
    assert flag(argv, "--kv-cache-dtype") == expected


@pytest.mark.parametrize(("dtype", "kv_dtype"), [("bfloat16", "float16"), ("float32", "bfloat16")])
def test_kv_dtype_vllm_cannot_store_is_refused(dtype: str, kv_dtype: str) -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        kv_cache_dtype(dtype, kv_dtype)
    with pytest.raises(ValueError, match=kv_dtype):
        config(dtype=dtype, kv_dtype=kv_dtype)


def test_extra_args_come_last_verbatim() -> None:
    extra = ("--gpu-memory-utilization", "0.85", "--max-num-seqs", "8")
    argv = serve_argv(config(extra_args=extra))
    assert tuple(argv[-4:]) == extra
    assert argv.count("--max-num-seqs") == 2  # vLLM's parser keeps the last


def test_env_names_the_side_channel_when_disaggregated() -> None:
    assert serve_env(BASE) == {SIDE_CHANNEL_PORT_ENV: str(NIXL_SIDE_CHANNEL_PORT)}
    local = config(side_channel_host="127.0.0.1", side_channel_port=5601, port=8001)
    assert serve_env(local) == {SIDE_CHANNEL_HOST_ENV: "127.0.0.1", SIDE_CHANNEL_PORT_ENV: "5601"}
    assert flag(serve_argv(local), "--port") == "8001"


@pytest.mark.parametrize(
    ("source", "served", "expected"),
    [
        ("/models/Meta-Llama-3-8B-Instruct", None, "Meta-Llama-3-8B-Instruct"),
        ("/models/Meta-Llama-3-8B-Instruct/", None, "Meta-Llama-3-8B-Instruct"),
        ("Qwen/Qwen2.5-0.5B-Instruct", None, "Qwen2.5-0.5B-Instruct"),
        ("/models/x", "my-model", "my-model"),
    ],
)
def test_served_name_is_the_spec_s_or_the_source_s_last_part(
    source: str, served: str | None, expected: str
) -> None:
    assert served_model_name(source, served) == expected


def test_source_without_a_name_is_refused() -> None:
    with pytest.raises(ValueError, match="no name"):
        served_model_name("/", None)


@pytest.mark.parametrize("name", ["block_size", "max_num_seqs", "tensor_parallel_size", "port"])
def test_non_positive_sizes_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        config(**{name: 0})


def test_fp8_weights_are_vllms_online_quantization_and_auto_leaves_the_checkpoints_own() -> None:
    assert flag(serve_argv(config(quantization="fp8")), "--quantization") == "fp8"
    assert flag(serve_argv(config()), "--quantization") is None  # vLLM reads the checkpoint's
    with pytest.raises(ValueError, match="as stored"):
        config(quantization="none")


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_host_tier_is_vllms_native_offloading_in_gib_for_the_whole_server() -> None:
    argv = serve_argv(config(role="colocated", tensor_parallel_size=2, kv_host_tier_bytes=64 << 30))
    assert _flag(argv, "--kv-offloading-backend") == "native"
    assert _flag(argv, "--kv-offloading-size") == "64"
    assert "--kv-transfer-config" not in argv
    assert "--kv-offloading-backend" not in serve_argv(config(role="colocated"))


@pytest.mark.parametrize(
    ("num_bytes", "gib"),
    [(1 << 30, "1"), (3 << 29, "1.5"), (1 << 20, "0.0009765625"), (1_500_000_000, "1.396484375")],
)
def test_offloading_size_rounds_down_to_whole_mib(num_bytes: int, gib: str) -> None:
    assert kv_offloading_size(num_bytes) == gib
    assert float(gib) * 2**30 <= num_bytes


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"role": "decode", "kv_host_tier_bytes": 1 << 30}, "needs colocated mode"),
        ({"role": "prefill", "kv_host_tier_bytes": 1 << 30}, "needs colocated mode"),
        ({"role": "colocated", "kv_host_tier_bytes": 4096}, "at least 1Mi"),
        ({"role": "colocated", "kv_host_tier_bytes": -1}, "must not be negative"),
        ({"role": "colocated", "kv_host_tier_bytes": 1 << 30, "kv_disk_tier_bytes": 1 << 30},
         "no disk KV tier"),
    ],
)  # fmt: skip
def test_tiers_vllm_cannot_run_are_refused_as_the_crd_refuses_them(
    changes: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        config(**changes)
