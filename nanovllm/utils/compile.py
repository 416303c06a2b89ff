"""``compile_on_cuda``: the small fused ops torch.compiled on CUDA (one kernel, not several); plain on CPU."""
from __future__ import annotations

import functools

import torch


def compile_on_cuda(fn):
    compiled = functools.cache(lambda: torch.compile(fn, dynamic=True))  # at the first call on CUDA

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        on_cuda = next(a for a in args if isinstance(a, torch.Tensor)).is_cuda
        return (compiled() if on_cuda else fn)(*args, **kwargs)

    return wrapper
