"""Gated activation: SiLU(gate) * up on the two halves of the merged gate/up projection."""
import torch
import torch.nn.functional as F

from nanovllm.utils.compile import compile_on_cuda


@compile_on_cuda
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [N, 2 * I] -> [N, I]
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up
