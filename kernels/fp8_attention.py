"""Causal attention of fresh prefill sequences in FP8, on cuDNN's flash attention (Hopper).

Not yet used on a GPU: the engine's layers call it on CUDA only once `_FP8_ON_CUDA` in
`kvrail.worker.layers.attention` is set, after the GPU run of
`bench/engine/fp8_attention_ab.sh` (which sets it in the device's copy, runs the GPU tests of
this module, `bench/engine/fp8_attention.py`, the 8k prefill of the FP8 engine beside the tree
without it, and the logits against the bf16 engine's). Meanwhile the CPU runs the same path over
the reference (`kvrail.kernels.reference.fp8_causal_attention`).

With an FP8 KV cache, a prompt that starts at position 0 attends over exactly the K and V the
cache holds: `kvrail.kernels.rotary_kv.rotary_write_kv_fp8` hands q, k and v over in e4m3 (a
scale of 1, saturated, as the cache stores them) with the largest magnitude of v. cuDNN's FP8
SDPA multiplies them on FP8 tensor cores: the probabilities are quantized over a scale of 256
(they lie in [0, 1]), and the output over 256 / amax(v), a bound since every output row is a
convex combination of rows of v (`FP8_ATTENTION_RANGE`: below e4m3's 448, with room for the
rounding of the probabilities, which the first run's scales of 448 left none; cuDNN's tests
leave more). The output comes back as `QuantizedRows` for the output projection (one scale for
every row), so it is never widened to bfloat16 and quantized again.

What one H200 run showed (`bench/engine/fp8_attention_inference_2026-12-05.txt`, Llama-3-8B's
shape, a graph of cuDNN's inference mode): 0.58 ms a layer at 8,192 tokens (950 TFLOP/s) against
0.91 for cuDNN's bf16 attention, but wrong outputs (a relative error of 1.25; NaN with K and V
expanded to every head). cuDNN's own tests run Hopper's FP8 attention in training mode only, so
this module builds that graph (it also writes the softmax statistics, to a scratch buffer); its
speed and accuracy are what the next GPU run measures.

cuDNN builds a plan for every new shape (60-90 ms on the H200 in that run; the first in a
process about a second), as torch's own cuDNN attention does, so graphs are cached by shape and
only sequences of 4,096 tokens or more come here.

Needs the `nvidia-cudnn-frontend` package, 1.18 (its graph API over the cuDNN that torch loads;
`hack/device-wheels.sh` carries it to the lent GPU).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from kvrail.kernels.reference import FP8_ATTENTION_RANGE, QuantizedRows

E4M3 = torch.float8_e4m3fn
MIN_CAPABILITY = (9, 0)  # Hopper: cuDNN's FP8 flash attention


def supported(device: torch.device) -> bool:
    """Whether this device runs cuDNN's FP8 flash attention."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


@dataclass(frozen=True, slots=True)
class _Shape:
    device: int
    num_seqs: int
    length: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    out_dtype: torch.dtype  # e4m3, or bfloat16 / float16 for an output that is not quantized


_CUDNN_TYPES = {E4M3: "FP8_E4M3", torch.bfloat16: "BFLOAT16", torch.float16: "HALF"}


class _Graph:
    """One built cuDNN graph and the tensors `fp8_causal_attention` binds to it."""

    def __init__(self, shape: _Shape, handle: Any) -> None:
        import cudnn

        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        out_type = getattr(cudnn.data_type, _CUDNN_TYPES[shape.out_dtype])
        n, length, d = shape.num_seqs, shape.length, shape.head_dim
        graph = cudnn.pygraph(
            io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle
        )

        def packed(heads: int) -> tuple[list[int], list[int]]:  # [n, H, L, D] over [n*L, H, D]
            return [n, heads, length, d], [length * heads * d, d, heads * d, 1]

        def tensor(name: str, heads: int) -> Any:
            dim, stride = packed(heads)
            return graph.tensor(name=name, dim=dim, stride=stride, data_type=e4m3)

        self.q = tensor("q", shape.num_heads)
        self.k = tensor("k", shape.num_kv_heads)
        self.v = tensor("v", shape.num_kv_heads)
        scalar = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": f32}
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        self.scales = {name: graph.tensor(name=name, **scalar) for name in names}
        o, stats, amax_s, amax_o = graph.sdpa_fp8(
            q=self.q, k=self.k, v=self.v, **self.scales, generate_stats=True,
            attn_scale=shape.scale, use_causal_mask=True, name="causal_fp8",
        )  # fmt: skip
        dim, stride = packed(shape.num_heads)
        o.set_output(True).set_dim(dim).set_stride(stride).set_data_type(out_type)
        stats.set_output(True).set_dim([n, shape.num_heads, length, 1]).set_stride(
            [shape.num_heads * length, length, 1, 1]
        ).set_data_type(f32)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        self.o, self.stats, self.amax_s, self.amax_o = o, stats, amax_s, amax_o
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace_bytes = graph.get_workspace_size()
        self.stats_shape = (n, shape.num_heads, length, 1)


class _Device:
    """A device's cuDNN handle, constant scale tensors and graphs by shape."""

    def __init__(self, device: torch.device) -> None:
        import cudnn

        with torch.cuda.device(device):
            self.handle = cudnn.create_handle()
        one = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=device)
        self.one, self.p_scale = one, one * FP8_ATTENTION_RANGE
        self.p_descale = one / FP8_ATTENTION_RANGE
        self.graphs: dict[_Shape, _Graph] = {}


_devices: dict[int, _Device] = {}
_lock = threading.Lock()  # graphs are built once per shape, whichever thread gets there first


def _graph(shape: _Shape, device: torch.device) -> tuple[_Device, _Graph]:
    with _lock:
        state = _devices.get(shape.device)
        if state is None:
            state = _devices[shape.device] = _Device(device)
        graph = state.graphs.get(shape)
        if graph is None:
            graph = state.graphs[shape] = _Graph(shape, state.handle)
    return state, graph


def fp8_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_amax: torch.Tensor,
    num_seqs: int,
    scale: float,
    dtype: torch.dtype,
) -> QuantizedRows:
    """`num_seqs` equal-length sequences packed in q [n*L, Hq, D], k/v [n*L, Hkv, D] (e4m3, a
    scale of 1), each attending causally to itself; v_amax: float32 [1], the largest |v|. Returns
    the output's rows [n*L, Hq*D] in e4m3 with their float32 scales [n*L] (all the same), as
    activations of `dtype`."""
    descale_o = v_amax.reshape(1, 1, 1, 1).clamp(min=1e-6) / FP8_ATTENTION_RANGE
    out = _attend(q, k, v, num_seqs, scale, E4M3, descale_o)
    return QuantizedRows(out, descale_o.reshape(1).expand(q.shape[0]).contiguous(), dtype)


def fp8_causal_attention_widened(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The same attention with its output rows [n*L, Hq*D] in `dtype` (bfloat16 or float16),
    not quantized: the configuration cuDNN's FP8 tests also run, measured beside the quantized
    output by bench/engine/fp8_attention.py."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"an output in {dtype}: bfloat16 or float16 only")
    one = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    return _attend(q, k, v, num_seqs, scale, dtype, one)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, scale: float,
    out_dtype: torch.dtype, descale_o: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The output rows [n*L, Hq*D] in `out_dtype`, stored over 1 / `descale_o`."""
    import cudnn

    total, num_heads, head_dim = q.shape
    if num_seqs < 1 or total % num_seqs:
        raise ValueError(f"{total} tokens are not {num_seqs} sequences of one length")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != E4M3 or not x.is_contiguous():
            raise ValueError(f"{name} is {x.dtype}, not contiguous e4m3")
    if k.shape != v.shape or k.shape[0] != total or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q")
    if num_heads % k.shape[1] or head_dim % 16:
        raise ValueError(f"{num_heads} query heads over {k.shape[1]} KV heads of {head_dim}")
    if not supported(q.device):
        raise ValueError("cuDNN's FP8 attention needs a GPU of compute capability 9.0+")
    shape = _Shape(
        q.device.index or 0, num_seqs, total // num_seqs, num_heads, k.shape[1], head_dim,
        float(scale), out_dtype,
    )  # fmt: skip
    state, graph = _graph(shape, q.device)
    out = torch.empty(total, num_heads * head_dim, dtype=out_dtype, device=q.device)
    stats = torch.empty(graph.stats_shape, dtype=torch.float32, device=q.device)
    workspace = torch.empty(graph.workspace_bytes, dtype=torch.uint8, device=q.device)
    amaxes = torch.empty(2, dtype=torch.float32, device=q.device)
    s = graph.scales
    pack = {
        graph.q: q, graph.k: k, graph.v: v, graph.o: out, graph.stats: stats,
        s["descale_q"]: state.one, s["descale_k"]: state.one, s["descale_v"]: state.one,
        s["descale_s"]: state.p_descale, s["scale_s"]: state.p_scale, s["scale_o"]: 1 / descale_o,
        graph.amax_s: amaxes[0:1], graph.amax_o: amaxes[1:2],
    }  # fmt: skip
    cudnn.set_stream(handle=state.handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    graph.graph.execute(pack, workspace, handle=state.handle)
    return out
