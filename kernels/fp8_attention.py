"""Causal attention of fresh prefill sequences in FP8, on cuDNN's flash attention (Hopper).

The engine's layers take this path over an e4m3 KV cache for steps of fresh prompts of 4,096
tokens or more (`kvrail.worker.layers.attention.fp8_prefill_sequences`); the CPU runs the same
path over the reference (`kvrail.kernels.reference.fp8_causal_attention`).

With an FP8 KV cache, a prompt that starts at position 0 attends over exactly the K and V the
cache holds: `kvrail.kernels.rotary_kv.rotary_write_kv_fp8` hands q, k and v over in e4m3 (a
scale of 1, saturated, as the cache stores them) with the largest magnitude of v. cuDNN's FP8
SDPA multiplies them on FP8 tensor cores: the probabilities are quantized over a scale of 256
(they lie in [0, 1]), and the output over 256 / amax(v), a bound since every output row is a
convex combination of rows of v (`FP8_ATTENTION_RANGE`: below e4m3's 448, with room for the
rounding of the probabilities, which the first run's scales of 448 left none; cuDNN's tests
leave more). The output comes back as `QuantizedRows` for the output projection (one scale for
every row), so it is never widened to bfloat16 and quantized again.

On an H100 (`bench/studies/attention/fp8_attention_2026-12-05.txt`, Llama-3-8B's 32/8 heads): 0.625
ms a layer at 8,192 tokens (880 TFLOP/s) against 0.921 for cuDNN's bf16 attention, within 5% RMS of
float32 attention over the same e4m3 q, k and v (its GPU tests). A first version built cuDNN's
inference-mode graph with scales of 448, and its outputs were wrong on the H200 (a relative error of
1.25; `fp8_attention_inference_2026-12-05.txt`); this one builds the training-mode graph (which also
writes the softmax statistics, to a scratch buffer) with the headroom above. An output in bf16
instead of e4m3 is refused by cuDNN 9.19 on Hopper.

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


class _Graph:
    """One built cuDNN graph and the tensors `fp8_causal_attention` binds to it."""

    def __init__(self, shape: _Shape, handle: Any) -> None:
        import cudnn

        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
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
        o.set_output(True).set_dim(dim).set_stride(stride).set_data_type(e4m3)
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
        float(scale),
    )  # fmt: skip
    state, graph = _graph(shape, q.device)
    descale_o = v_amax.reshape(1, 1, 1, 1).clamp(min=1e-6) / FP8_ATTENTION_RANGE
    out = torch.empty(total, num_heads * head_dim, dtype=E4M3, device=q.device)
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
    return QuantizedRows(out, descale_o.reshape(1).expand(total).contiguous(), dtype)
