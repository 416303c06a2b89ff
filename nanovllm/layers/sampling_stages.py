"""The sampler's optional stages, each run only when a request in the batch asks for it:
penalties (presence, frequency, repetition), top-k/top-p, min-p."""
from __future__ import annotations

import torch


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, T] ids padded with vocab_size -> [B, V] occurrence counts."""
    counts = torch.zeros(ids.size(0), vocab_size + 1, dtype=torch.float32, device=ids.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, b) -> torch.Tensor:
    vocab_size = logits.size(1)
    counts = token_counts(b.output_ids, vocab_size)
    logits = (logits - b.frequency_penalty[:, None] * counts
              - b.presence_penalty[:, None] * (counts > 0))
    seen = (counts > 0) | (token_counts(b.prompt_ids, vocab_size) > 0)
    rep = b.repetition_penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps each row's k most likely tokens and its smallest set with probability >= p (at least
    one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        keep &= torch.arange(logits.size(1), device=logits.device)[None, :] < top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    return torch.empty_like(logits).scatter_(1, order,
                                             sorted_logits.masked_fill(~keep, float("-inf")))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values,
                              float("-inf"))
