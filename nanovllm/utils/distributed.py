"""Tensor-parallel process groups (each engine its own: torch.distributed's default one exists once a process),
and the rank, size and group that layers read while built inside ``tensor_parallel``."""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

# how long a collective waits for a peer alive but stuck (a dead one is noticed within seconds)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


_IN_FORKED_CHILD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forget_in_forked_child(owner, forget: Callable[[object], None]):
    """Calls ``forget(owner)`` in a child forked while ``owner`` lives: the parent's workers, shared memory and
    finalizers are not the child's to end."""
    _IN_FORKED_CHILD[owner] = forget


os.register_at_fork(after_in_child=lambda: [forget(owner) for owner, forget in list(_IN_FORKED_CHILD.items())])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """Gloo or NCCL collectives over a TCP store; rank 0 waits for every rank, calling ``waiting()`` between
    checks (it raises when a worker died)."""

    def __init__(self, rank: int, size: int, port: int, device: str, waiting: Callable[[], None] | None = None):
        self.rank, self.size = rank, size
        self.store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT,
                                   wait_for_workers=False)
        if rank > 0:
            self.store.set(f"connected/{rank}", "1")
        else:
            while not self.store.check([f"connected/{peer}" for peer in range(1, size)]):
                if waiting is not None:
                    waiting()
                time.sleep(0.01)
        self.backend = (dist.ProcessGroupNCCL(self.store, rank, size) if device == "cuda"
                        else dist.ProcessGroupGloo(self.store, rank, size, COLLECTIVE_TIMEOUT))

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        self.backend.allreduce([x], op).wait()
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.backend.broadcast(x, src).wait()
        return x

    def gather(self, x: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's ``x`` on ``dst`` (in rank order); None elsewhere."""
        options = dist.GatherOptions()
        options.rootRank = dst
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == dst else []
        self.backend.gather(parts, [x], options).wait()
        return parts[0] if self.rank == dst else None

    def abort(self):
        """Ends the operations in flight without waiting (NCCL's would wait forever for a dead rank)."""
        for name in ("abort", "_abort", "shutdown"):  # the first that this torch has and that works
            with contextlib.suppress(Exception):
                getattr(self.backend, name)()
                return


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
