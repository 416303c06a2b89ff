"""Sampling on rank 0: greedy where temperature is 0, otherwise a draw from softmax(logits / T)."""
from __future__ import annotations

import torch
from torch import nn


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor,
                generator: torch.Generator | None = None) -> torch.Tensor:
        # logits [num_seqs, vocab]; temperatures [num_seqs] -> token ids [num_seqs]
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
        probs = torch.softmax(logits / safe_t.unsqueeze(1), dim=-1)
        # Gumbel-max in its exponential form: argmax p_i / E_i with E_i ~ Exp(1) samples i with probability p_i.
        noise = torch.empty_like(probs).exponential_(1, generator=generator).clamp_min_(1e-20)
        sampled = probs.div_(noise).argmax(dim=-1)
        return torch.where(temperatures > 0, sampled, greedy)
