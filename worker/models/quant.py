"""Weight quantization: which one a model runs in, from the setting and the checkpoint.

`quantization` is `auto` (the checkpoint's own: FP8 for an FP8 checkpoint, else none), `none`
or `fp8`. FP8 means e4m3 weights with one float32 scale per output row in every projection of
the decoder layers (the embedding, the norms and the LM head stay in the model's dtype), and
activations quantized to e4m3 at each projection: with the checkpoint's static `input_scale`
where it has them, else with a dynamic scale per token. A float checkpoint is quantized at load,
each rank quantizing its own shard (so a row-parallel projection's scales depend on the
tensor-parallel size, which is in the fingerprint too). An FP8 checkpoint in the common layout
(`quantization_config.quant_method: fp8`; each projection's `weight` in e4m3 with its
`weight_scale`, per tensor or per row, and `input_scale` with static activations) is loaded as
stored: a per-tensor scale becomes the scale of each of its rows, and a fused projection (q, k
and v; gate and up) takes the largest of its parts' input scales.

On a GPU, FP8 weights need FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper)
and bfloat16 activations (the FP8 GEMM's output type); the projections run in
`kvrail.kernels.dispatch` (both operands in e4m3 on the tensor cores: the inputs of QKV and
gate/up quantized per token, or with the static scale, by the RMSNorms that write them; at
decode sizes the skinny kernel quantizes the output and down projections' inputs itself, per
row and 128-column tile, and larger batches quantize them per token before cuBLASLt's FP8
GEMM). On CPU the torch reference
computes them in float32, slower than float32 itself (it is the logic's reference, not a fast
path).

Refused, never run some other way: block-wise scales, checkpoints that leave a projection
unquantized, other quantization methods, `none` for an FP8 checkpoint, FP8 on a GPU older than
8.9, and FP8 weights on CUDA with activations in another dtype than bfloat16.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import torch

from kvrail.errors import ConfigError

Quantization = Literal["none", "fp8"]
QUANTIZATIONS: Final = ("auto", "none", "fp8")


def checkpoint_quantization(config: Any) -> Quantization:
    """The quantization a transformers config's `quantization_config` declares, checked."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return "none"
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"kvrail loads float and FP8 checkpoints only, not {method!r} ones")
    if qc.get("weight_block_size"):
        raise ConfigError(
            f"this FP8 checkpoint has block-wise weight scales ({qc['weight_block_size']}): "
            "kvrail reads a scale per tensor or per row only"
        )
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise ConfigError(f"unknown FP8 activation_scheme {qc['activation_scheme']!r}")
    skipped = [*(qc.get("ignored_layers") or ()), *(qc.get("modules_to_not_convert") or ())]
    unquantized = [name for name in skipped if name.rsplit(".", 1)[-1] != "lm_head"]
    if unquantized:
        raise ConfigError(
            f"this FP8 checkpoint leaves {unquantized[:3]} unquantized: kvrail quantizes every "
            "projection of the decoder layers"
        )
    return "fp8"


def resolve_quantization(setting: str, config: Any) -> Quantization:
    """What the model runs in for setting `setting` (see the module docstring)."""
    if setting not in QUANTIZATIONS:
        raise ConfigError(f"quantization {setting!r} is not one of {', '.join(QUANTIZATIONS)}")
    stored = checkpoint_quantization(config)
    if setting == "auto":
        return stored
    if setting == "none" and stored == "fp8":
        raise ConfigError(
            "this checkpoint is FP8: its weights load as stored (quantization auto or fp8); "
            "kvrail does not dequantize a checkpoint"
        )
    return "fp8" if setting == "fp8" else "none"


FP8_CAPABILITY: Final = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores and conversions (Ada; Hopper is 9.0)."""


def check_fp8_device(what: str, device_type: str) -> None:
    """Refuse `what` (an FP8 mode, for the message) on a CUDA device without FP8 support."""
    if device_type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < FP8_CAPABILITY:
        raise ConfigError(
            f"{what} on {torch.cuda.get_device_name()} (compute capability {major}.{minor}): "
            f"kvrail's FP8 kernels need compute capability {FP8_CAPABILITY[0]}."
            f"{FP8_CAPABILITY[1]} or later (Ada, Hopper)"
        )


def check_device(quantization: Quantization, device_type: str, dtype: torch.dtype) -> None:
    """Refuse FP8 weights where kvrail has no FP8 kernels for them: a GPU older than 8.9, or
    CUDA activations in another dtype than bfloat16."""
    if quantization != "fp8" or device_type != "cuda":
        return
    check_fp8_device("FP8 weights", device_type)
    if dtype != torch.bfloat16:
        raise ConfigError(
            f"FP8 weights on CUDA compute in bfloat16 (the FP8 GEMM's output type), not {dtype}: "
            "set dtype to bfloat16 or auto"
        )
