"""Does the prefill attention pay a setup per new prompt length? (lent H200; issue 23)

    python3 -P bench/studies/attention/sdpa_shapes.py

`causal_self_attention` (worker/layers/attention.py) calls torch's scaled_dot_product_attention
on [n, H, L, D] views; on Hopper torch picks cuDNN's fused attention, which builds an execution
plan per new shape. Serving sees a new L with nearly every prompt. For 12 lengths never seen
before, and then again, this times one call of the Llama-3-8B layer's shape (32 query heads, 8
KV heads, head size 128, bf16) per backend: cuDNN, flash (KV heads expanded when the backend
cannot group them), and the default choice.
"""

from __future__ import annotations

import time

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel


def call(backend: SDPBackend | None, n: int, length: int, expand: bool) -> float:
    q = torch.randn(n, 32, length, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, 8, length, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if expand:
        k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if backend is None:
        functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not expand)
    else:
        with sdpa_kernel([backend]):
            functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not expand)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    base = 601
    for name, backend, expand in (
        ("default", None, False),
        ("cudnn", SDPBackend.CUDNN_ATTENTION, False),
        ("flash, KV expanded", SDPBackend.FLASH_ATTENTION, True),
        ("flash, enable_gqa", SDPBackend.FLASH_ATTENTION, False),
    ):
        try:
            call(backend, 1, 64, expand)  # the backend's own first-use cost, not a new length's
            lengths = [base + 37 * i for i in range(12)]
            base += 1000
            first = [call(backend, 1, n, expand) for n in lengths]
            again = [call(backend, 1, n, expand) for n in lengths]
        except RuntimeError as err:
            print(f"{name}: unavailable ({str(err).splitlines()[0][:100]})")
            continue
        steady = []
        for n, length in ((1, 600), (3, 600), (1, 2048), (1, 8192)):
            call(backend, n, length, expand)
            steady.append(
                f"{n}x{length} {min(call(backend, n, length, expand) for _ in range(5)):.3f}"
            )
        print(
            f"{name}: new length: median {sorted(first)[6]:.2f} ms, max {max(first):.2f} ms; "
            f"seen length: median {sorted(again)[6]:.3f} ms (lengths {lengths[0]}-{lengths[-1]}); "
            f"steady ms: {', '.join(steady)}"
        )


if __name__ == "__main__":
    main()
