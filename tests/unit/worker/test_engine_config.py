"""EngineConfig's defaults are Settings' (one default per value) and its checks."""

from __future__ import annotations

import dataclasses

import pytest

from kvrail.errors import ConfigError
from kvrail.settings import Settings
from kvrail.worker.engine.config import EngineConfig

FROM_SETTINGS = (
    "block_size", "max_num_batched_tokens", "max_num_seqs", "max_num_mixed_prefill_tokens",
    "max_mixed_graph_tokens", "zero_kv_on_release", "kv_dtype", "kv_host_tier_bytes",
    "kv_disk_tier_path", "kv_disk_tier_bytes",
)  # fmt: skip
"""The fields the worker fills from the Settings field of the same name."""


@pytest.mark.parametrize("name", FROM_SETTINGS)
def test_a_field_the_worker_fills_from_settings_defaults_to_settings_default(name: str) -> None:
    assert getattr(EngineConfig(num_blocks=2), name) == getattr(Settings(), name)


def test_every_field_named_after_a_setting_is_one_the_worker_fills() -> None:
    shared = {f.name for f in dataclasses.fields(EngineConfig)} & set(Settings.model_fields)
    assert shared - {"max_model_len"} == set(FROM_SETTINGS)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_blocks": 1}, "num_blocks"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"kv_dtype": "int4"}, "kv_dtype"),
        ({"kv_disk_tier_path": "/tmp/kv"}, "kv_disk_tier_path and kv_disk_tier_bytes"),
        ({"kv_disk_tier_path": "/tmp/kv", "kv_disk_tier_bytes": 1 << 30}, "kv_host_tier_bytes"),
        ({"kv_host_tier_bytes": -1}, "KV tier sizes"),
    ],
)
def test_invalid_engine_config_names_the_field(change: dict[str, object], message: str) -> None:
    values: dict[str, object] = {"num_blocks": 8, **change}
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**values)  # type: ignore[arg-type]
