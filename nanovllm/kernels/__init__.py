"""Kernels. Attention's backends are chosen once at start-up (``nanovllm.layers.attention``); the dense
layers' ops (RMSNorm, SiLU-and-mul, the fused linear) follow the tensor: ``dense_ops(x)`` is Triton's
(``triton_linear``) for a CUDA tensor when triton is installed, the PyTorch reference otherwise; so do the
mixture-of-experts layer's (``moe_ops(x)``: ``triton_moe``, else ``moe_reference``)."""
from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType

import torch

from nanovllm.kernels import moe_reference, reference


@functools.cache
def _triton_module(name: str, fallback: ModuleType) -> ModuleType:
    """``nanovllm.kernels.<name>``, imported once; ``fallback`` where triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return fallback
    return importlib.import_module(f"nanovllm.kernels.{name}")


def dense_ops(x: torch.Tensor) -> ModuleType:
    return _triton_module("triton_linear", reference) if x.is_cuda else reference


def moe_ops(x: torch.Tensor) -> ModuleType:
    """The module whose ``fused_moe`` runs the experts for tokens x."""
    return _triton_module("triton_moe", moe_reference) if x.is_cuda else moe_reference


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision for inputs of ``dtype``: fp32 inputs would otherwise go through tf32
    (10-bit mantissa); keep fp32 exact."""
    return "ieee" if dtype == torch.float32 else "tf32"
