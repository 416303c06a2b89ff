"""Tensor-parallel rank and size as seen by the layers while a model is being built.

Each engine builds its model inside ``tensor_parallel(rank, size)``; layers read the values
once at construction, so engines of different sizes can live side by side in one process.
Collectives use the default process group, which only an engine with size > 1 creates.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

_TP = (0, 1)


def get_tp() -> tuple[int, int]:
    """(rank, world_size) of the model under construction."""
    return _TP


@contextmanager
def tensor_parallel(rank: int, size: int):
    global _TP
    previous, _TP = _TP, (rank, size)
    try:
        yield
    finally:
        _TP = previous


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(x)
    return x
