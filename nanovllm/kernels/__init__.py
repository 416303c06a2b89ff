"""Kernel dispatch: the dense and MoE ops follow the tensor (Triton's for CUDA tensors when triton is installed);
attention's backend is chosen at start-up (``layers.attention``)."""
from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch

from nanovllm.kernels import moe_reference, reference


@functools.cache
def _triton_module(name: str, fallback: ModuleType) -> ModuleType:
    if importlib.util.find_spec("triton") is None:
        return fallback
    return importlib.import_module(f"nanovllm.kernels.{name}")


def dense_ops(x: torch.Tensor) -> ModuleType:
    return _triton_module("triton_linear", reference) if x.is_cuda else reference


def fp8_ops(x: torch.Tensor) -> ModuleType | None:
    """Triton's fp8-weight linear for a CUDA tensor (when triton is installed), else None (the reference)."""
    return _triton_module("triton_fp8", None) if x.is_cuda else None


def moe_ops(x: torch.Tensor) -> ModuleType:
    return _triton_module("triton_moe", moe_reference) if x.is_cuda else moe_reference


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision: fp32 inputs stay exact instead of going through tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"
