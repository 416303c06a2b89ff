"""RMSNorm; the residual add before it runs in the previous projection."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.linear import dense_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_ops(x).rms_norm(x.reshape(-1, x.size(-1)), self.weight, self.eps).view(x.shape)
