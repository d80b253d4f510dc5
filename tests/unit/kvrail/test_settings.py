from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from kvrail.crd.spec import BlockSize, ModelSpec, RoleSpec
from kvrail.errors import ConfigError
from kvrail.settings import Settings, format_scorers, load_settings, read_secret


def test_defaults_need_no_environment() -> None:
    s = load_settings(environ={})
    assert s == Settings()
    assert s.etcd_endpoints == ("http://127.0.0.1:2379",)


def test_environment_overrides_file_which_overrides_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "kvrail.yaml"
    cfg.write_text("pool: from-file\nnamespace: team-a\nblockSize: 32\n")
    env = {"KVRAIL_CONFIG": str(cfg), "KVRAIL_POOL": "from-env",
           "KVRAIL_ETCD_ENDPOINTS": "http://10.0.0.1:2379,http://10.0.0.2:2379"}  # fmt: skip
    s = load_settings(environ=env)
    assert (s.pool, s.namespace, s.block_size) == ("from-env", "team-a", 32)
    assert s.etcd_endpoints == ("http://10.0.0.1:2379", "http://10.0.0.2:2379")


@pytest.mark.parametrize("block_size", get_args(BlockSize))
def test_settings_take_the_block_sizes_a_pool_may_name(block_size: int) -> None:
    assert load_settings(environ={"KVRAIL_BLOCK_SIZE": str(block_size)}).block_size == block_size


def test_router_scorers_are_name_weight_pairs_in_the_environment(tmp_path: Path) -> None:
    s = load_settings(environ={"KVRAIL_ROUTER_SCORERS": "prefix-cache=1, load=8"})
    assert [(x.name, x.weight) for x in s.router_scorers] == [("prefix-cache", 1), ("load", 8)]
    assert format_scorers(s.router_scorers) == "prefix-cache=1,load=8"
    assert load_settings(environ={"KVRAIL_ROUTER_SCORERS": ""}).router_scorers == ()
    cfg = tmp_path / "kvrail.yaml"
    cfg.write_text("routerScorers:\n- {name: kv-utilization, weight: 4}\n")
    (only,) = load_settings(cfg, environ={}).router_scorers
    assert (only.name, only.weight) == ("kv-utilization", 4)


def test_settings_default_to_the_pool_api_defaults() -> None:
    model, role = ModelSpec(), RoleSpec()
    assert Settings().block_size == model.block_size
    assert Settings().max_num_seqs == role.max_num_seqs
    assert Settings().max_num_batched_tokens == role.max_num_batched_tokens


@pytest.mark.parametrize(
    "env,message",
    [
        ({"KVRAIL_POOL": "Bad_Name"}, "pool"),
        ({"KVRAIL_BLOCK_SIZE": "0"}, "block_size"),
        ({"KVRAIL_BLOCK_SIZE": "sixteen"}, "block_size"),
        ({"KVRAIL_BLOCK_SIZE": "12"}, "block_size"),
        ({"KVRAIL_BLOCK_SIZE": "1024"}, "block_size"),
        ({"KVRAIL_ROUTER_SCORERS": "load"}, "router_scorers"),
        ({"KVRAIL_ROUTER_SCORERS": "queue=1"}, "router_scorers"),
        ({"KVRAIL_ROUTER_SCORERS": "load=-1"}, "router_scorers"),
        ({"KVRAIL_ETCD_ENDPOINTS": "localhost"}, "etcd_endpoints"),
        ({"KVRAIL_NATS_URL": "http://x:1"}, "nats_url"),
        ({"KVRAIL_LOG_LEVEL": "LOUD"}, "log_level"),
        ({"KVRAIL_POLL": "x"}, "unknown setting KVRAIL_POLL"),
        ({"KVRAIL_KV_TRANSFER_LAYER_GROUPS": "-1"}, "kv_transfer_layer_groups"),
        ({"KVRAIL_KV_TRANSFER_LAYER_GROUPS": "automatic"}, "kv_transfer_layer_groups"),
        ({"KVRAIL_KV_TRANSFER_LAYER_GROUPS": "1025"}, "kv_transfer_layer_groups"),
    ],
)
def test_invalid_settings_name_the_field(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(environ=env)


def test_layer_groups_are_a_count_or_auto_and_go_with_tensor_parallelism(tmp_path: Path) -> None:
    env = {"KVRAIL_KV_TRANSFER_LAYER_GROUPS": "4", "KVRAIL_TENSOR_PARALLEL_SIZE": "2"}
    assert load_settings(environ=env).kv_transfer_layer_groups == 4
    assert (
        load_settings(environ={"KVRAIL_KV_TRANSFER_LAYER_GROUPS": "auto"}).kv_transfer_layer_groups
        == "auto"
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kvTransferLayerGroups: auto\n")
    assert load_settings(cfg, environ={}).kv_transfer_layer_groups == "auto"
    assert Settings().kv_transfer_layer_groups == 0  # off by default


@pytest.mark.parametrize(
    "content,message",
    [
        ("pool: [unclosed", "not valid YAML"),
        ("- a\n- b\n", "mapping"),
        ("colour: red\n", "unknown"),
    ],
)
def test_invalid_config_files_are_refused(tmp_path: Path, content: str, message: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_settings(cfg, environ={})


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "absent.yaml", environ={})


def test_credentials_come_from_files(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    s = load_settings(environ={"KVRAIL_ETCD_PASSWORD_FILE": str(secret)})
    assert read_secret(s.etcd_password_file) == "s3cret"
    assert "s3cret" not in repr(s)
    with pytest.raises(ConfigError, match="cannot read credential file"):
        read_secret(tmp_path / "absent")


def test_the_old_role_spelling_both_means_colocated() -> None:
    assert load_settings(environ={"KVRAIL_ROLE": "both"}).role == "colocated"
    assert load_settings(environ={"KVRAIL_ROLE": "colocated"}).role == "colocated"


def test_the_kernels_pdl_switch_is_a_setting_not_an_unknown_variable() -> None:
    """kvrail.kernels reads KVRAIL_PDL itself; the settings must accept it, not refuse to start."""
    assert load_settings(environ={"KVRAIL_PDL": "0"}).pdl is False
    assert load_settings(environ={}).pdl is True


def test_describe_settings_lists_every_setting_with_its_values() -> None:
    from kvrail.settings import Settings, describe_settings

    lines = describe_settings().splitlines()
    assert [line.split("=", 1)[0] for line in lines] == [
        f"KVRAIL_{name.upper()}" for name in Settings.model_fields
    ]
    by_name = {line.split("=", 1)[0]: line for line in lines}
    assert (
        "[auto | float32 | float16 | bfloat16 | float8_e4m3fn | float8_e5m2]"
        in by_name["KVRAIL_KV_DTYPE"]
    )
    assert by_name["KVRAIL_QUANTIZATION"].startswith(
        "KVRAIL_QUANTIZATION='auto' [auto | none | fp8]"
    )


def test_kvrail_config_options_prints_them(capsys: pytest.CaptureFixture[str]) -> None:
    from kvrail.cli.main import main
    from kvrail.settings import describe_settings

    assert main(["config", "--options"]) == 0
    assert capsys.readouterr().out == describe_settings()
