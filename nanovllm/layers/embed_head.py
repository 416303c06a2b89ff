"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.linear import check_shape, dense_ops
from nanovllm.utils.context import get_context
from nanovllm.utils.distributed import all_reduce, get_tp, get_tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tied: nn.Parameter | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp()
        self.tp_group = get_tp_group()
        self.num_embeddings = num_embeddings
        rows = (num_embeddings + self.tp_size - 1) // self.tp_size
        self.vocab_start_idx = rows * self.tp_rank
        self.vocab_end_idx = min(self.vocab_start_idx + rows, num_embeddings)
        if tied is None:  # tied: the embedding's weight, which a tied LM head shares
            tied = nn.Parameter(torch.zeros(rows, embedding_dim), requires_grad=False)
            tied.weight_loader = self.weight_loader
        self.weight = tied

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        check_shape(loaded, (self.num_embeddings, param.size(1)))
        shard = loaded[self.vocab_start_idx:self.vocab_end_idx]
        param.data[:shard.size(0)].copy_(shard)  # the last rank's padding rows stay zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return nn.functional.embedding(x, self.weight)
        mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = nn.functional.embedding(mask * (x - self.vocab_start_idx), self.weight)
        return all_reduce(mask.unsqueeze(1) * y, self.tp_group)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits on rank 0 (None elsewhere); in prefill only the rows ``logits_indices`` names."""
        if (context := get_context()).is_prefill:
            x = x[context.logits_indices].contiguous()
        logits = dense_ops(x).linear(x, self.weight)
        if self.tp_size == 1:
            return logits
        parts = self.tp_group.gather(logits, 0)
        return torch.cat(parts, -1)[:, :self.num_embeddings] if self.tp_rank == 0 else None
