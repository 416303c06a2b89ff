"""Sampling on rank 0: greedy where temperature is 0, otherwise a draw from softmax(logits / T)."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.utils.compile import compile_on_cuda


@compile_on_cuda
def sample(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    # logits [num_seqs, vocab]; temperatures [num_seqs]; noise [num_seqs, vocab] ~ Exp(1)
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits / safe_t.unsqueeze(1), dim=-1)
    # Gumbel-max in its exponential form: argmax p_i / E_i with E_i ~ Exp(1) samples i with probability p_i.
    sampled = (probs / noise.clamp_min(1e-20)).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, greedy)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """Token ids [num_seqs]; the noise is drawn eagerly from ``generator`` (reproducible)."""
        noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        noise.exponential_(1, generator=generator)
        return sample(logits, temperatures, noise)
