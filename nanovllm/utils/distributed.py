"""The rank, size and group that layers read while built inside ``tensor_parallel`` (the groups
themselves: ``engine.worker_group.TPGroup``), and what a forked child forgets."""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanovllm.engine.worker_group import TPGroup

_IN_FORKED_CHILD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forget_in_forked_child(owner, forget: Callable[[object], None]):
    """Calls ``forget(owner)`` in a child forked while ``owner`` lives: the parent's workers,
    shared memory and finalizers are not the child's to end."""
    _IN_FORKED_CHILD[owner] = forget


os.register_at_fork(after_in_child=lambda: [forget(owner) for owner, forget
                                            in list(_IN_FORKED_CHILD.items())])


class _TPState(threading.local):
    rank, size, group = 0, 1, None


_TP = _TPState()


def get_tp() -> tuple[int, int]:
    """(rank, world_size) of the model this thread builds."""
    return _TP.rank, _TP.size


def get_tp_group() -> TPGroup | None:
    """The group of the model this thread builds (None without tensor parallelism)."""
    return _TP.group


@contextlib.contextmanager
def tensor_parallel(rank: int, size: int, group: TPGroup | None = None):
    previous = _TP.rank, _TP.size, _TP.group
    _TP.rank, _TP.size, _TP.group = rank, size, group
    try:
        yield
    finally:
        _TP.rank, _TP.size, _TP.group = previous


def all_reduce(x: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    return group.all_reduce(x) if group is not None and group.size > 1 else x
