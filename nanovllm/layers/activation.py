"""Gated activation: SiLU(gate) * up on the two halves of the merged gate/up projection."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 2 * I] -> [N, I]
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
