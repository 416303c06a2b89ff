"""Kernels. Attention's backends are chosen once at start-up (``nanovllm.layers.attention``); the dense
layers' ops (RMSNorm, SiLU-and-mul, the fused linear) follow the tensor: ``dense_ops(x)`` is Triton's
(``triton_linear``) for a CUDA tensor when triton is installed, the PyTorch reference otherwise; so do the
mixture-of-experts layer's (``moe_ops(x)``: ``triton_moe``, else ``moe_reference``)."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
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


PDL_ENV = "NANOVLLM_PDL"


@functools.cache
def _pdl_supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> int:
    """How the decode path's Triton kernels on ``device`` use programmatic dependent launch (PDL, Hopper and
    later): 0 not; else each kernel is launched while the one before it ends, and waits for it
    (``griddepcontrol.wait``) before it reads that kernel's output (what reads no earlier output, the skinny
    linear's weights prefetched into L2, goes first); 1: a kernel lets the next one launch as it starts, 2: before
    its last stores. ``NANOVLLM_PDL`` (default 0) sets it where the GPU supports PDL; never under the Triton
    interpreter. Measured on an H200 in docs/PERFORMANCE.md."""
    flag = os.environ.get(PDL_ENV, "0")
    if flag not in ("0", "1", "2"):
        raise ValueError(f"{PDL_ENV}={flag!r}: expected 0, 1 or 2")
    if flag == "0" or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    return int(flag) if _pdl_supported(device.index if device.index is not None else torch.cuda.current_device()) \
        else 0
