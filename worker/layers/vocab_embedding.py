"""The token embedding, split over the vocabulary (`kvrail.worker.parallel.layout`).

Rank r holds rows `[vocab_start, vocab_start + num_rows)` of the table (the last rank's rows past
the vocabulary are zero). A token outside its rows looks up row 0 and is zeroed, and one
all-reduce sums the ranks' lookups: every token gets exactly its one row (x + 0 is exact, so the
result is the unsplit lookup bit for bit). With a group of one it is `nn.Embedding`'s lookup.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from kvrail.worker.parallel.group import TpGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_rows: int, hidden_size: int, vocab_start: int, group: TpGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size))
        nn.init.normal_(self.weight)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return functional.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = functional.embedding(local.masked_fill(outside, 0), self.weight)
        rows.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(rows)
