"""Tensor-parallel linear layers: column-parallel ones split the output features (q/k/v or gate/up packed into one
matmul), row-parallel ones the input features, all-reducing their output."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.kernels import dense_ops
from nanovllm.utils.distributed import all_reduce, get_tp, get_tp_group


def check_shape(loaded: torch.Tensor, expected: torch.Size | tuple[int, ...]):
    """Checks a whole checkpoint tensor's shape (the loader adds its name to the error)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {tuple(expected)}")


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp()
        self.tp_group = get_tp_group()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, loaded: torch.Tensor, dim: int | None, full_shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's slice along ``dim`` (None: all) of a checkpoint tensor of ``full_shape``."""
        check_shape(loaded, full_shape)
        if dim is None or self.tp_size == 1:
            return loaded
        size = loaded.size(dim) // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_ops(x).linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias)
        self.weight.replicated_rank = self.tp_rank  # dummy weights: the same on every rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        param.data.copy_(self._shard(loaded, None, param.shape))


class MergedColumnParallelLinear(LinearBase):
    """Column-parallel ``output_sizes`` in one matmul; checkpoint part ``shard_id`` goes at its offset."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes) // get_tp()[1], bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        full = (self.output_sizes[shard_id], *param.shape[1:])
        param.data.narrow(0, offset, size).copy_(self._shard(loaded, 0, full))

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """With ``silu_mul``, SiLU(gate) * up of the two parts."""
        return dense_ops(x).linear(x, self.weight, self.bias, silu_mul=silu_mul)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v in one matmul (shard ids "q", "k", "v"); each rank holds its heads of each."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size = get_tp()[1]
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads // tp_size, num_kv_heads // tp_size
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        super().weight_loader(param, loaded, "qkv".index(shard_id))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size // get_tp()[1], output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        dim = 1 if param.dim() == 2 else None  # the bias is whole on every rank
        full = tuple(n * self.tp_size if d == dim else n for d, n in enumerate(param.shape))
        param.data.copy_(self._shard(loaded, dim, full))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T + bias, added in place to ``residual``; both on rank 0 only, before the all-reduce."""
        first = self.tp_rank == 0
        y = dense_ops(x).linear(x, self.weight, self.bias if first else None, residual=residual if first else None)
        return all_reduce(y, self.tp_group)
