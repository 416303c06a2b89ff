"""Tensor-parallel groups, and the rank, size and group that layers see while a model is being built.

Each engine has a process group of its own (``TPGroup``: a TCP store on a free port and a gloo or NCCL
backend built on it), never torch.distributed's default group, which a process can create only once: so
engines live side by side in one process, and an engine can start after one that failed to.
Each engine builds its model inside ``tensor_parallel(rank, size, group)``; layers read the values once
at construction. The values are per thread, so engines can be built in different threads.
"""
from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

# A collective waits this long for a peer that is alive but stuck (a dead peer is noticed within seconds).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """The collectives tensor parallelism needs, on this engine's own process group."""

    def __init__(self, rank: int, size: int, port: int, device: str,
                 waiting: Callable[[], None] | None = None):
        """Connects to the group's store (rank 0 hosts it) and builds the backend. Rank 0 first waits for
        every other rank to connect, calling ``waiting()`` between checks (it raises if a worker died, so
        that a worker that never arrives is named instead of waited for)."""
        self.rank, self.size, self.device = rank, size, device
        self.store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT,
                                   wait_for_workers=False)
        if rank == 0:
            for peer in range(1, size):
                self._wait_for(f"connected/{peer}", waiting)
        else:
            self.store.set(f"connected/{rank}", "1")
        if device == "cuda":
            self.backend = dist.ProcessGroupNCCL(self.store, rank, size)
        else:
            self.backend = dist.ProcessGroupGloo(self.store, rank, size, COLLECTIVE_TIMEOUT)

    def _wait_for(self, key: str, waiting: Callable[[], None] | None):
        while not self.store.check([key]):
            if waiting is not None:
                waiting()
            time.sleep(0.01)

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.backend.allreduce([x], options).wait()
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.backend.broadcast([x], options).wait()
        return x

    def gather(self, x: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's ``x`` on ``dst`` (in rank order); None elsewhere."""
        options = dist.GatherOptions()
        options.rootRank = dst
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == dst else []
        self.backend.gather(parts, [x], options).wait()
        return parts[0] if self.rank == dst else None

    def abort(self):
        """Ends the operations in flight without waiting for them (NCCL waits forever for a dead rank)."""
        for name in ("abort", "_abort", "shutdown"):
            fn = getattr(self.backend, name, None)
            if fn is not None:
                try:
                    fn()
                    return
                except Exception:  # best effort on a broken group
                    continue


class _TPState(threading.local):
    rank, size, group = 0, 1, None


_TP = _TPState()


def get_tp() -> tuple[int, int]:
    """(rank, world_size) of the model under construction (in this thread)."""
    return _TP.rank, _TP.size


def get_tp_group() -> TPGroup | None:
    """The group of the model under construction (None without tensor parallelism)."""
    return _TP.group


@contextmanager
def tensor_parallel(rank: int, size: int, group: TPGroup | None = None):
    previous = _TP.rank, _TP.size, _TP.group
    _TP.rank, _TP.size, _TP.group = rank, size, group
    try:
        yield
    finally:
        _TP.rank, _TP.size, _TP.group = previous


def all_reduce(x: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    if group is not None and group.size > 1:
        group.all_reduce(x)
    return x
