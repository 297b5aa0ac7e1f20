"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of the group size and split in contiguous ranges;
padded rows are zero and their logits are sliced off after the gather.
"""

from __future__ import annotations

import torch
from torch import nn

from .arguments import positive_int
from .collectives import all_reduce_rows, gather_last_dim
from .packed import linear
from .parallel import Group
from .shards import take


class VocabParallelEmbedding(nn.Module):
    """out[t] = E[ids[t]]: each rank looks up its vocab range, the group sums; rows unchanged."""

    def __init__(self, vocab_size: int, hidden_size: int, group: Group, dtype=torch.float32):
        super().__init__()
        who = type(self).__name__
        positive_int(who, "hidden_size", hidden_size)
        self.group, self.vocab_size = group, positive_int(who, "vocab_size", vocab_size)
        self.per_rank = -(-vocab_size // group.size)
        # trailing ranks may hold only padding
        self.start = min(group.rank * self.per_rank, vocab_size)
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise RuntimeError(f"expected the full shape {(self.vocab_size, param.shape[1])} "
                               f"(vocab_size, hidden_size)")
        param.data.zero_()
        rows = max(0, self.end - self.start)  # the last ranks may hold padding only
        if rows:
            param.data[:rows].copy_(take(loaded, 0, self.start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(outside, 0)
        out = nn.functional.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return all_reduce_rows(out, self.group, site="embed")


VocabParallelEmbedding.weight_loader.reads_slices = True  # its vocab rows only


class ParallelLMHead(VocabParallelEmbedding):
    """logits[t] = h[t] @ E.T over the full vocabulary: vocab slices gathered; rows unchanged."""

    packs_weight = True  # runtime/packed.py: a CPU weight packed once at load
    packed = None

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(self, hidden)
        logits = gather_last_dim(logits, self.group, site="lm_head")
        return logits[..., : self.vocab_size]
