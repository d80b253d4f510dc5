"""How a Llama-family model splits over the ranks of one worker (Megatron-style), as arithmetic.

Rank r of T holds:
- query heads `[r * H/T, (r + 1) * H/T)`: T must divide the H attention heads;
- KV heads: with K >= T KV heads, `[r * K/T, (r + 1) * K/T)` (T must divide K); with fewer KV
  heads than ranks, the one KV head its query heads read, `r // (T/K)`, replicated on T/K ranks
  (K must divide T). Either way a rank's query heads read only the KV heads it holds;
- MLP columns `[r * I/T, (r + 1) * I/T)` of the intermediate size I (T must divide I);
- vocabulary rows `[r * Vp, (r + 1) * Vp)` with `Vp = ceil(V / T)`; the last rank's rows past V
  are zero padding, and the logits of padded rows are dropped after the gather.

QKV and gate/up are column-parallel (each rank computes its own heads and columns), O and down
row-parallel (partial sums, one all-reduce each), the embedding vocabulary-parallel (a masked
lookup, one all-reduce) and the LM head too (each rank's logits, gathered on rank 0). The KV
cache of a rank holds only its KV heads: block b is the same block on every rank, and a KV
transfer between two workers of one layout moves rank i's shard to rank i.

This split is the "tensor-parallel layout" of the model fingerprint: it is a function of
(H, K, I, V, T) alone, so two workers share it exactly when they share the model and T.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrail.errors import ConfigError

MAX_TENSOR_PARALLEL_SIZE = 8
"""One pod, one node: the GPUs of one NVLink domain (the InferencePool CRD says the same)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, MAX_TENSOR_PARALLEL_SIZE) + 1) if n % d == 0]


def check_tensor_parallel_size(
    tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int
) -> None:
    """Raise ConfigError, naming the sizes that would work, unless the model splits over
    `tp_size` ranks (see the module docstring)."""
    if not 1 <= tp_size <= MAX_TENSOR_PARALLEL_SIZE:
        raise ConfigError(
            f"tensor_parallel_size={tp_size} is outside 1..{MAX_TENSOR_PARALLEL_SIZE}"
        )
    fits = [
        t
        for t in _divisors(num_heads)
        if intermediate_size % t == 0
        and (num_kv_heads % t == 0 if num_kv_heads >= t else t % num_kv_heads == 0)
    ]
    if tp_size in fits:
        return
    if num_heads % tp_size:
        why = f"it does not divide the model's {num_heads} attention heads"
    elif num_kv_heads >= tp_size and num_kv_heads % tp_size:
        why = f"it does not divide the model's {num_kv_heads} KV heads"
    elif num_kv_heads < tp_size and tp_size % num_kv_heads:
        why = f"the model's {num_kv_heads} KV heads do not divide it (for replication)"
    else:
        why = f"it does not divide the model's intermediate size {intermediate_size}"
    sizes = ", ".join(map(str, fits))
    raise ConfigError(
        f"tensor_parallel_size={tp_size} cannot split this model: {why}; sizes that work: {sizes}"
    )


@dataclass(frozen=True, slots=True)
class TpLayout:
    """What rank `rank` of `size` holds of a model with these sizes (see the module docstring).
    Checked when built: a layout that cannot exist raises ConfigError."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is outside 0..{self.size - 1}")
        check_tensor_parallel_size(
            self.size, self.num_heads, self.num_kv_heads, self.intermediate_size
        )

    @classmethod
    def single(
        cls, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int
    ) -> TpLayout:
        return cls(0, 1, num_heads, num_kv_heads, intermediate_size, vocab_size)

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def head_start(self) -> int:
        return self.rank * self.num_local_heads

    @property
    def num_local_kv_heads(self) -> int:
        return max(self.num_kv_heads // self.size, 1)

    @property
    def kv_head_start(self) -> int:
        if self.num_kv_heads >= self.size:
            return self.rank * self.num_local_kv_heads
        return self.rank // (self.size // self.num_kv_heads)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1 unless there are fewer KV heads than ranks)."""
        return max(self.size // self.num_kv_heads, 1)

    @property
    def local_intermediate_size(self) -> int:
        return self.intermediate_size // self.size

    @property
    def intermediate_start(self) -> int:
        return self.rank * self.local_intermediate_size

    @property
    def padded_vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.padded_vocab_per_rank

    @property
    def vocab_end(self) -> int:
        """One past this rank's last real vocabulary row (rows up to the padded width are 0)."""
        end = min(self.vocab_start + self.padded_vocab_per_rank, self.vocab_size)
        return max(end, self.vocab_start)
