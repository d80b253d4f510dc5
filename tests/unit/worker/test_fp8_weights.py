"""FP8 weights on CPU (the reference path the GPU kernels will be tested against): e4m3 values
with a scale per output row in every decoder projection, quantized at load from a float
checkpoint or loaded as stored from an FP8 one (per-tensor or per-row `weight_scale`, static
`input_scale`), tensor-parallel shards included; and every combination kvrail cannot run is
refused. What FP8 costs in accuracy is measured, not asserted here
(bench/engine/fp8_accuracy.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvrail.errors import ConfigError
from kvrail.kernels import reference
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.engine import LLMEngine, make_fingerprint
from kvrail.worker.models.llama import LlamaForCausalLM
from kvrail.worker.models.loader import LazyWeights
from kvrail.worker.models.quant import check_device, resolve_quantization
from kvrail.worker.parallel.group import TpGroup
from kvrail.worker.testing import assert_engine_empty, make_engine_config, tiny_llama_config

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_state(seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_llama_config()).eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fp8_checkpoint(
    state: dict[str, torch.Tensor], static: bool
) -> tuple[dict[str, torch.Tensor], Any]:
    """`state` as an FP8 checkpoint in the common layout: each projection's weight in e4m3 with
    one scale per tensor, and with `static`, one input scale each."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if module not in PROJECTIONS:
            out[name] = tensor
            continue
        scale = tensor.abs().max() / 448
        out[name] = (tensor / scale).to(FP8)
        out[name.replace(".weight", ".weight_scale")] = scale.reshape(())
        if static:
            out[name.replace(".weight", ".input_scale")] = torch.tensor(0.01 + 0.001 * len(out))
    config = tiny_llama_config()
    config.quantization_config = {
        "quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
    }  # fmt: skip
    return out, config


def _engine(model: LlamaForCausalLM) -> LLMEngine:
    config = make_engine_config(max_model_len=256)
    return LLMEngine(model, config, make_fingerprint(model, config, "w", "t"), eos_token_id=None)


def test_a_quantized_row_keeps_its_largest_value_and_rounds_the_rest_to_e4m3() -> None:
    torch.manual_seed(0)
    weight = torch.randn(6, 40)
    weight[2] = 0.0
    values, scale = reference.quantize_fp8_rows(weight)
    assert values.dtype == FP8 and scale.shape == (6,)
    assert (values.float().abs().amax(dim=1)[[0, 1, 3, 4, 5]] == 448).all()
    assert not values[2].float().any()  # an all-zero row stays zero
    restored = values.float() * scale[:, None]
    # e4m3: 3 mantissa bits (half a step is 2^-4 of a value), subnormal steps of 2^-9
    assert ((restored - weight).abs() <= weight.abs() / 16 + scale[:, None] / 512 + 1e-7).all()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_an_fp8_linear_is_the_product_of_its_two_fp8_operands(static: bool) -> None:
    torch.manual_seed(1)
    x, weight, bias = torch.randn(5, 40), torch.randn(24, 40), torch.randn(24)
    values, scale = reference.quantize_fp8_rows(weight)
    input_scale = torch.tensor(0.02) if static else None
    got = reference.fp8_linear(x, values, scale, bias, input_scale)
    x_scale = input_scale if static else x.abs().amax(dim=1, keepdim=True) / 448
    xq = (x / x_scale).clamp(-448, 448).to(FP8).float() * x_scale
    torch.testing.assert_close(got, xq @ (values.float() * scale[:, None]).T + bias)
    exact = x @ weight.T + bias
    assert (got - exact).norm() < 0.1 * exact.norm()  # and near the float product


def test_online_quantization_makes_every_decoder_projection_fp8_and_nothing_else() -> None:
    state = _hf_state()
    config = tiny_llama_config()
    plain = LlamaForCausalLM.build(config, state, dtype=torch.float32, device="cpu")
    fp8 = LlamaForCausalLM.build(config, state, dtype=torch.float32, device="cpu",
                                 quantization="fp8")  # fmt: skip
    assert plain.quantization == "none" and fp8.quantization == "fp8"
    for name, param in fp8.named_parameters():
        projection = name.rsplit(".", 2)[-2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        assert (param.dtype == FP8) == projection, name
    qkv = fp8.layers[1].qkv_proj
    assert qkv.weight_scale is not None and qkv.weight_scale.shape == (qkv.out_features,)
    assert qkv.input_scale is None  # dynamic activation scales
    values, scale = reference.quantize_fp8_rows(plain.layers[1].qkv_proj.weight)
    assert torch.equal(qkv.weight.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(qkv.weight_scale, scale)
    engines = [_engine(plain), _engine(fp8)]
    assert engines[1].fingerprint.quantization == "fp8"
    assert engines[0].fingerprint.digest != engines[1].fingerprint.digest
    assert b"quantization" not in engines[0].fingerprint.canonical()  # older digests unchanged
    outputs = engines[1].generate([list(range(5, 40)), [3, 4]], SamplingParams(max_tokens=8))
    assert [len(o) for o in outputs] == [8, 8]
    assert_engine_empty(engines[1])


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_an_fp8_checkpoint_loads_as_stored(static: bool, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    checkpoint, config = _fp8_checkpoint(_hf_state(), static)
    assert resolve_quantization("auto", config) == "fp8"
    save_file(checkpoint, str(tmp_path / "model.safetensors"))
    for state in (checkpoint, LazyWeights([tmp_path / "model.safetensors"])):  # eager and lazy
        model = LlamaForCausalLM.build(config, state, dtype=torch.float32, device="cpu",
                                       quantization="fp8")  # fmt: skip
        qkv = model.layers[0].qkv_proj
        parts = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
        stored = torch.cat([checkpoint[f"{p}.weight"] for p in parts])
        assert torch.equal(qkv.weight.view(torch.uint8), stored.view(torch.uint8))
        scales = [checkpoint[f"{p}.weight_scale"].expand(checkpoint[f"{p}.weight"].shape[0])
                  for p in parts]  # fmt: skip
        assert qkv.weight_scale is not None and torch.equal(qkv.weight_scale, torch.cat(scales))
        if static:
            assert qkv.input_scale == max(checkpoint[f"{p}.input_scale"] for p in parts)
        else:
            assert qkv.input_scale is None
    engine = _engine(model)
    assert len(engine.generate([list(range(5, 30))], SamplingParams(max_tokens=6))[0]) == 6
    assert_engine_empty(engine)


def test_tensor_parallel_shards_of_an_fp8_checkpoint_are_its_rows_and_columns() -> None:
    checkpoint, config = _fp8_checkpoint(_hf_state(), static=False)
    shards = [
        LlamaForCausalLM(config, TpGroup(rank, 2)).to(dtype=torch.float32) for rank in range(2)
    ]
    for model in shards:
        for module in model.projections():
            module.to_fp8_()
        model.load_weights(checkpoint)
    down = "model.layers.1.mlp.down_proj"
    columns = torch.cat([m.layers[1].down_proj.weight.view(torch.uint8) for m in shards], dim=1)
    assert torch.equal(columns, checkpoint[f"{down}.weight"].view(torch.uint8))
    for model in shards:  # a row-parallel projection's scales are every output row's
        scale = model.layers[1].down_proj.weight_scale
        assert scale is not None and (scale == checkpoint[f"{down}.weight_scale"]).all()
    gate = "model.layers.0.mlp.gate_proj"
    rows = torch.cat([m.layers[0].gate_up_proj.weight[:24].view(torch.uint8) for m in shards])
    assert torch.equal(rows, checkpoint[f"{gate}.weight"].view(torch.uint8))


def _refusal(change: str) -> tuple[dict[str, torch.Tensor], Any]:
    checkpoint, config = _fp8_checkpoint(_hf_state(), static=change == "partial static")
    if change == "missing scale":
        del checkpoint["model.layers.1.self_attn.k_proj.weight_scale"]
    elif change == "partial static":
        del checkpoint["model.layers.0.mlp.down_proj.input_scale"]
    elif change == "scale of an unquantized weight":
        checkpoint["model.norm.weight_scale"] = torch.tensor(1.0)
    elif change == "wrong number of scales":
        checkpoint["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(5)
    return checkpoint, config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing scale", "weights missing or of the wrong size"),
        ("partial static", "input_scale missing"),
        ("scale of an unquantized weight", "no projection"),
        ("wrong number of scales", "5 scales for 32 rows"),
    ],
)
def test_an_inconsistent_fp8_checkpoint_is_refused(change: str, message: str) -> None:
    checkpoint, config = _refusal(change)
    with pytest.raises(ConfigError, match=message):
        LlamaForCausalLM.build(config, checkpoint, dtype=torch.float32, device="cpu",
                               quantization="fp8")  # fmt: skip


def test_an_fp8_weight_into_an_unquantized_model_is_refused() -> None:
    checkpoint, config = _fp8_checkpoint(_hf_state(), static=False)
    with pytest.raises(ConfigError, match="is FP8 but"):
        LlamaForCausalLM.build(config, checkpoint, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize(
    ("quantization_config", "setting", "message"),
    [
        ({"quant_method": "awq"}, "auto", "not 'awq'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "auto", "block-wise"),
        ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]}, "auto",
         "unquantized"),
        ({"quant_method": "fp8"}, "none", "does not dequantize"),
        (None, "int4", "not one of"),
    ],
)  # fmt: skip
def test_what_kvrail_cannot_run_is_refused_by_name(
    quantization_config: dict[str, Any] | None, setting: str, message: str
) -> None:
    config = tiny_llama_config()
    if quantization_config is not None:
        config.quantization_config = quantization_config
    with pytest.raises(ConfigError, match=message):
        resolve_quantization(setting, config)


def test_quantization_resolves_from_the_checkpoint_and_fp8_needs_an_fp8_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = tiny_llama_config()
    assert resolve_quantization("auto", config) == "none"
    assert resolve_quantization("fp8", config) == "fp8"
    config.quantization_config = {"quant_method": "fp8", "ignored_layers": ["lm_head"]}
    assert resolve_quantization("auto", config) == "fp8"
    check_device("fp8", "cpu", torch.float32)
    check_device("none", "cuda", torch.float16)
    # this machine has no GPU: the two device queries the refusal makes are answered for one
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    with pytest.raises(ConfigError, match=r"FP8 weights on NVIDIA A100 .*8\.9 or later"):
        check_device("fp8", "cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    check_device("fp8", "cuda", torch.bfloat16)
    with pytest.raises(ConfigError, match="compute in bfloat16"):
        check_device("fp8", "cuda", torch.float16)


def test_an_engine_from_an_fp8_checkpoint_directory_runs_fp8_with_auto(tmp_path: Path) -> None:
    """The loader's own path: a safetensors directory whose config.json declares FP8."""
    import json

    from safetensors.torch import load_file, save_file

    from kvrail.worker.engine.config import EngineConfig
    from kvrail.worker.testing import write_random_model

    path = write_random_model(tmp_path / "fp8", seed=3)
    checkpoint, _ = _fp8_checkpoint(load_file(path / "model.safetensors"), static=False)
    save_file(checkpoint, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))
    engine_config = EngineConfig(num_blocks=32, block_size=4, max_model_len=128)
    engine = LLMEngine.from_source(str(path), engine_config)
    assert engine.fingerprint.quantization == "fp8"
    assert engine.model.layers[2].gate_up_proj.weight.dtype == FP8
    assert len(engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4))[0]) == 4
    assert_engine_empty(engine)
    with pytest.raises(ConfigError, match="does not dequantize"):
        LLMEngine.from_source(str(path), engine_config, quantization="none")
