"""``compile_on_cuda``: torch.compile for the small fused ops when they run on CUDA, as nano-vllm
does (one kernel instead of several); on CPU the plain function runs (compiling buys nothing there)."""
from __future__ import annotations

import functools

import torch


def compile_on_cuda(fn):
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if not first.is_cuda:
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args, **kwargs)

    return wrapper
