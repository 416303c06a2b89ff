"""RMSNorm, optionally fused with the residual add (returns the new residual too)."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.kernels import dense_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The norm over the last dim (of x + residual: then also returns that sum, the new residual)."""
        flat = x.reshape(-1, x.size(-1))
        out, new_residual = dense_ops(x).rms_norm(flat, self.weight, self.eps,
                                                  None if residual is None else residual.reshape(flat.shape))
        if residual is None:
            return out.view(x.shape)
        return out.view(x.shape), new_residual.view(x.shape)
