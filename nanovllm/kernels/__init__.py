"""Kernel dispatch: an op follows its tensor (Triton's module for a CUDA tensor when triton is
installed, the PyTorch reference otherwise); attention's backend is chosen at start-up
(``layers.attention``)."""
from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType

import torch


@functools.cache
def triton_module(name: str, fallback: ModuleType | None) -> ModuleType | None:
    """``nanovllm.kernels.<name>``, or ``fallback`` without triton."""
    if importlib.util.find_spec("triton") is None:
        return fallback
    return importlib.import_module(f"nanovllm.kernels.{name}")


def ops_for(x: torch.Tensor, name: str, fallback: ModuleType | None) -> ModuleType | None:
    """The Triton module ``name`` for a CUDA tensor, else ``fallback``."""
    return triton_module(name, fallback) if x.is_cuda else fallback


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision: fp32 inputs stay exact instead of going through tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"
