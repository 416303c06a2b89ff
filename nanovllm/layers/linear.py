"""Linear layers sharded for tensor parallelism, each parameter with its own ``weight_loader``
that copies this rank's shard of a checkpoint tensor.

Column-parallel layers split the output features (no communication); row-parallel layers
split the input features and all-reduce their output. QKV and gate/up are packed into one
column-parallel matmul; their loaders place each checkpoint tensor at its offset.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.distributed import all_reduce, get_tp, get_tp_group


def check_shape(loaded: torch.Tensor, expected: torch.Size | tuple[int, ...]):
    """``expected`` is the whole checkpoint tensor's shape (checked before a rank takes its shard);
    the loader names the tensor when it catches this error."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {tuple(expected)}")


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp()
        self.tp_group = get_tp_group()
        self.tp_dim = tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, loaded: torch.Tensor, dim: int | None, full_shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's slice along ``dim`` (None: all of it) of a checkpoint tensor that must be ``full_shape``."""
        check_shape(loaded, full_shape)
        if dim is None or self.tp_size == 1:
            return loaded
        size = loaded.size(dim) // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        dim = self.tp_dim if self.tp_dim is not None and param.dim() > self.tp_dim else None  # a row bias is whole
        full = tuple(n * self.tp_size if d == dim else n for d, n in enumerate(param.shape))
        param.data.copy_(self._shard(loaded, dim, full))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp_size = get_tp()[1]
        super().__init__(input_size, output_size // tp_size, bias, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        full = (self.output_sizes[shard_id], *param.shape[1:])
        param.data.narrow(0, offset, size).copy_(self._shard(loaded, 0, full))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its heads of each."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size = get_tp()[1]
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = num_kv_heads // tp_size
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        full = (size * self.tp_size, *param.shape[1:])
        param.data.narrow(0, offset, size).copy_(self._shard(loaded, 0, full))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp_size = get_tp()[1]
        super().__init__(input_size // tp_size, output_size, bias, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bias is added once, on rank 0, before the sum over ranks
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y, self.tp_group)
