"""The model fingerprint: what two workers must share to exchange KV blocks.

Prefill and decode workers with different fingerprints never pair, and the fingerprint seeds every
block hash, so a prefix cached under one model layout can never be matched under another. Bump
`FINGERPRINT_VERSION` whenever the meaning of a field or the encoding changes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

FINGERPRINT_VERSION = 1
_DTYPES = frozenset({"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
_LAYOUTS = frozenset({"NHD", "HND"})
_QUANTIZATIONS = frozenset({"none", "fp8"})


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Everything that decides the bytes of a KV block and the tokens that index it.

    `weights_id` identifies the weights (for example the sha256 of the GGUF file or of the
    safetensors index); `tokenizer_id` the tokenizer files; `quantization` what the weights
    run in (`none`, or `fp8`: quantized at load or stored so, which `weights_id` tells apart).
    The KV shape fields make a block's size computable by arithmetic:
    `2 * num_layers * num_kv_heads * head_dim * block_size * itemsize` (per rank: see
    `kv_bytes_per_block`).

    The tensor-parallel layout is `tensor_parallel_size` T with `num_kv_heads` K: rank r of a
    worker holds KV heads `[r * K/T, (r + 1) * K/T)` when T divides K, else (T a multiple of K)
    the one head `r // (T/K)`, replicated. So two workers with equal fingerprints hold the same
    heads on the same ranks, and a KV transfer moves rank i's shard to rank i. Workers of
    different T never pair, even where a decode worker could re-shard what it receives: the
    digest differs, so neither the router nor a prefill worker ever matches them.
    """

    weights_id: str
    tokenizer_id: str
    dtype: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str = "NHD"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    tensor_parallel_size: int = 1
    quantization: str = "none"

    def __post_init__(self) -> None:
        if not self.weights_id or not self.tokenizer_id:
            raise ValueError("fingerprint needs a weights_id and a tokenizer_id")
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(
                f"fingerprint quantization={self.quantization!r} is not one of "
                f"{sorted(_QUANTIZATIONS)}"
            )
        for name in ("dtype", "kv_dtype"):
            value = getattr(self, name)
            if value not in _DTYPES:
                raise ValueError(f"fingerprint {name}={value!r} is not one of {sorted(_DTYPES)}")
        if self.kv_layout not in _LAYOUTS:
            raise ValueError(
                f"fingerprint kv_layout={self.kv_layout!r} is not one of {sorted(_LAYOUTS)}"
            )
        for name in (
            "block_size",
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "tensor_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"fingerprint {name} must be at least 1, got {getattr(self, name)}"
                )
        heads, ranks = self.num_kv_heads, self.tensor_parallel_size
        if (heads % ranks) if heads >= ranks else (ranks % heads):
            raise ValueError(
                f"num_kv_heads={heads} and tensor_parallel_size={ranks}: neither is divisible "
                "by the other, so the KV heads do not split (or replicate) over the ranks"
            )

    def canonical(self) -> bytes:
        """The exact bytes hashed: sorted-key JSON with the version, stable across Python runs."""
        payload = {"version": FINGERPRINT_VERSION, **asdict(self)}
        payload["rope_scaling"] = [list(kv) for kv in self.rope_scaling]
        if self.quantization == "none":  # added later: unquantized digests stay as they were
            del payload["quantization"]
        return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        """Hex sha256 of `canonical()`; the value workers publish and compare."""
        return hashlib.sha256(self.canonical()).hexdigest()

    @property
    def short(self) -> str:
        """A 12-character prefix, safe to log and to put in labels."""
        return self.digest[:12]

    def kv_bytes_per_block(self, itemsize: int) -> int:
        """Bytes of one block across all layers, K and V, on one tensor-parallel rank."""
        heads = max(self.num_kv_heads // self.tensor_parallel_size, 1)
        return 2 * self.num_layers * heads * self.head_dim * self.block_size * itemsize

    def is_compatible(self, other: ModelFingerprint) -> bool:
        return self.digest == other.digest
