"""Tensor-parallel linear layers: column-parallel ones split the output features (q/k/v or gate/up
packed into one matmul), row-parallel ones the input features and all-reduce their output."""
from __future__ import annotations

import contextlib
import math
import threading

import torch
from torch import nn

from nanovllm.kernels import reference, triton_module
from nanovllm.utils.distributed import all_reduce, get_tp, get_tp_group

QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dense_ops(x: torch.Tensor):
    return triton_module("triton_linear", reference) if x.is_cuda else reference


class LinearMethod:
    """``create_weights`` replaces a new layer's plain ``weight``; ``apply`` is its forward."""

    def create_weights(self, layer: LinearBase) -> None:
        pass

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
        return dense_ops(x).linear(x, layer.weight, bias, residual=residual, silu_mul=silu_mul)


class _State(threading.local):
    factory = None  # linear_methods'
    dry_run = False  # inside shapes_only()


_STATE = _State()


@contextlib.contextmanager
def linear_methods(factory):
    """Linear layers built inside take ``factory(layer)``'s method (None: the plain one)."""
    previous, _STATE.factory = _STATE.factory, factory
    try:
        yield
    finally:
        _STATE.factory = previous


class ShapeChecked(Exception):
    """Raised by ``check_shape`` in ``shapes_only()`` once a shape passed: the loader stops."""


@contextlib.contextmanager
def shapes_only():
    """Weight loaders' dry run: each checks dtype and whole shape, then ``check_shape`` stops it."""
    previous, _STATE.dry_run = _STATE.dry_run, True
    try:
        yield
    finally:
        _STATE.dry_run = previous


def check_shape(loaded: torch.Tensor, expected: torch.Size | tuple[int, ...]):
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {tuple(expected)}")
    if _STATE.dry_run:
        raise ShapeChecked


def check_dtype(loaded: torch.Tensor, param: torch.Tensor):
    """fp8 tensors go to fp8 parameters only, and only they do (bf16 would lose the scale)."""
    quantized = param.dtype in QUANTIZED_DTYPES
    if (loaded.dtype in QUANTIZED_DTYPES) != quantized:
        why = "config.json's quantization_config makes this layer fp8" if quantized else \
            "the model is not fp8 here (config.json's quantization_config, modules_to_not_convert)"
        raise ValueError(f"is {loaded.dtype} but the model expects {param.dtype}: {why}")


def blocks(param: torch.Tensor, dim: int, size: int, what: str) -> int:
    """``size`` weight rows (dim 0) or columns (dim 1) in ``param``'s units (``block``: how many one
    scale element covers; none may straddle a split); a per-channel scale (None): one column."""
    block = getattr(param, "block", (1, 1))[dim]
    if block is None:
        return 1
    if size % block:
        raise ValueError(f"{what} ({size}) is not a multiple of the fp8 weight block size {block}")
    return size // block


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp()
        self.tp_group = get_tp_group()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quant_method = (_STATE.factory and _STATE.factory(self)) or LinearMethod()
        self.quant_method.create_weights(self)
        bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.register_parameter("bias", bias)
        if bias is not None:
            bias.weight_loader = self.weight_loader

    def _shard(self, loaded: torch.Tensor, dim: int | None, full_shape: tuple[int, ...],
               param: torch.Tensor) -> torch.Tensor:
        """This rank's slice along ``dim`` (None: all) of a checkpoint tensor of ``full_shape``."""
        check_dtype(loaded, param)
        check_shape(loaded, full_shape)
        if dim is None or self.tp_size == 1:
            return loaded
        size = loaded.size(dim) // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias, None, False)


class ReplicatedLinear(LinearBase):
    quantizable = False  # the MoE router: unquantized, as vLLM builds it

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias)
        self.weight.replicated_rank = self.tp_rank  # dummy weights: the same on every rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        param.data.copy_(self._shard(loaded, None, param.shape, param))


class MergedColumnParallelLinear(LinearBase):
    """Column-parallel ``output_sizes`` in one matmul; checkpoint part ``shard_id`` at its rows."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes) // get_tp()[1], bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        split = len(self.output_sizes) > 1 or self.tp_size > 1
        per_rank = " per rank" if self.tp_size > 1 else ""
        sizes = [blocks(param, 0, n // self.tp_size, f"{self.part_name(i)}'s rows{per_rank}")
                 if split else math.ceil(n / getattr(param, "block", (1,))[0])
                 for i, n in enumerate(self.output_sizes)]
        full = (sizes[shard_id] * self.tp_size, *param.shape[1:])
        param.data.narrow(0, sum(sizes[:shard_id]), sizes[shard_id]).copy_(
            self._shard(loaded, 0, full, param))

    def part_name(self, shard_id: int) -> str:
        return f"output part {shard_id}"

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias, None, silu_mul)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v in one matmul (shard ids "q", "k", "v"); each rank holds its heads of each."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp_size, kv_size = get_tp()[1], num_kv_heads * head_dim
        self.head_dim, self.num_heads = head_dim, num_heads // tp_size
        self.num_kv_heads = num_kv_heads // tp_size
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        super().weight_loader(param, loaded, "qkv".index(shard_id))

    def part_name(self, shard_id: int) -> str:
        return f"{'qkv'[shard_id]}_proj"


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size // get_tp()[1], output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        dim = 1 if param.dim() == 2 and getattr(param, "block", (1, 1))[1] else None  # bias: whole
        if dim is not None and self.tp_size > 1:
            blocks(param, 1, self.weight.size(1), "input features per rank")
        full = tuple(n * self.tp_size if d == dim else n for d, n in enumerate(param.shape))
        param.data.copy_(self._shard(loaded, dim, full, param))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual += x @ weight.T + bias (both on rank 0 only), then the all-reduce."""
        bias, residual = (self.bias, residual) if self.tp_rank == 0 else (None, None)
        return all_reduce(self.quant_method.apply(self, x, bias, residual, False), self.tp_group)
