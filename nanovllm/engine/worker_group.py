"""Tensor parallelism's processes: rank 0's ``WorkerGroup`` spawns, calls, watches and ends a worker
per rank > 0, which runs ``worker_main``. A wait on a peer ends when the peer dies (EOF, a broken
pipe, ``WorkerDiedError``)."""
from __future__ import annotations

import contextlib
import copyreg
import ctypes
import datetime
import functools
import glob
import io
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.layers.linear import QUANTIZED_DTYPES
from nanovllm.plugins import REGISTRY
from nanovllm.utils.distributed import forget_in_forked_child

SEGMENT_PREFIX = "nanovllm-"
SEGMENT_SIZE = 2 ** 20  # the first segment; a larger call moves to a larger one
JOIN_TIMEOUT_S = 5.0  # a worker told to exit gets this long before it is killed
MAIN_GUARD_HINT = ("workers start by 'spawn', which imports the main script again: create the LLM "
                   "under `if __name__ == \"__main__\":`")


def _reduce_tensor(tensor: torch.Tensor):
    """Tensors as torch pickles them, but float8 ones (which do not survive torch 2.13's own pickle
    on CPU) as their bytes and dtype."""
    if tensor.dtype in QUANTIZED_DTYPES:
        return _from_bytes, (tensor.detach().contiguous().view(torch.uint8), tensor.dtype)
    return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return data.view(dtype)


_DISPATCH = copyreg.dispatch_table.copy()
_DISPATCH[torch.Tensor] = _DISPATCH[torch.nn.Parameter] = _reduce_tensor


def dumps(obj) -> bytes:
    """The call channel's pickle: ``pickle.dumps`` with float8 tensors sent as bytes."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(obj)
    return buffer.getvalue()


# how long a collective waits for a peer alive but stuck (a dead one is noticed within seconds)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """Gloo or NCCL collectives over a TCP store; rank 0 waits for every rank, calling ``waiting()``
    between checks (it raises when a worker died)."""

    def __init__(self, rank: int, size: int, port: int, device: str,
                 waiting: Callable[[], None] | None = None):
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
        """Ends the operations in flight without waiting (NCCL's would wait forever for a dead
        rank)."""
        for name in ("abort", "_abort", "shutdown"):  # the first that this torch has and that works
            with contextlib.suppress(Exception):
                getattr(self.backend, name)()
                return


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker ended while the engine needed it."""


DEATH_GRACE_S = 3.0  # a collective fails a moment before the dead peer's exit status is known


def create_segment(name: str, size: int) -> SharedMemory:
    """A segment whose memory is reserved now: on a full /dev/shm, a plain
    ``SharedMemory(create=True)`` would succeed and its first write kill the process (SIGBUS)."""
    if not os.path.isdir("/dev/shm"):
        return SharedMemory(name=name, create=True, size=size)
    fd = os.open(path := f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.unlink(path)
        raise RuntimeError(f"cannot reserve {size} bytes of shared memory in /dev/shm "
                           f"({e.strerror})") from None
    finally:
        os.close(fd)
    return SharedMemory(name=name)


class CallChannel:
    """Pickled calls in shared memory, each announced on a doorbell pipe per worker. Header: the
    payload's length, then each worker's count of calls read; rank 0 writes once every worker has
    read the call before."""

    def __init__(self, name: str, world_size: int, rank: int):
        self.name, self.rank, self.header = name, rank, 8 * (world_size + 1)
        # 0: the length; r: rank r's count
        self.slots = [slice(8 * r, 8 * r + 8) for r in range(world_size)]
        self.shm = (create_segment(name, max(SEGMENT_SIZE, self.header + 1)) if rank == 0
                    else SharedMemory(name=name))
        self.num_calls = self.moves = 0

    def write(self, payload: bytes, death_error) -> bytes:
        """Writes the next call; returns the doorbells' message (the new segment's name, if it
        moved)."""
        while any(int.from_bytes(self.shm.buf[slot], "little") != self.num_calls
                  for slot in self.slots[1:]):
            if error := death_error():
                raise error
            time.sleep(1e-4)
        moved = b""
        if self.header + len(payload) > self.shm.size:  # every worker has read this one: move
            self.close()
            self.moves += 1
            self.shm = create_segment(f"{self.name}-{self.moves}",
                                      1 << (self.header + len(payload) - 1).bit_length())
            moved = self.shm.name.encode()
        self.shm.buf[self.slots[0]] = len(payload).to_bytes(8, "little")
        self.shm.buf[self.header:self.header + len(payload)] = payload
        self.num_calls += 1
        return moved

    def read(self, doorbell) -> tuple[str, tuple] | None:
        """A worker's next (method name, args); None once rank 0 is gone."""
        try:
            moved = doorbell.recv_bytes()
        except EOFError:
            return None
        if moved:
            self.shm.close()
            self.shm = SharedMemory(name=moved.decode())
        size = int.from_bytes(self.shm.buf[self.slots[0]], "little")
        call = pickle.loads(self.shm.buf[self.header:self.header + size])
        self.num_calls += 1
        self.shm.buf[self.slots[self.rank]] = self.num_calls.to_bytes(8, "little")
        return call

    def close(self):
        self.shm.close()
        with contextlib.suppress(FileNotFoundError):
            self.shm.unlink()


class WorkerGroup:
    def __init__(self, config: Config):
        self.config, self.world_size = config, config.tensor_parallel_size
        for path in glob.glob(f"/dev/shm/{SEGMENT_PREFIX}*"):  # left by killed engines
            pid = os.path.basename(path).split("-")[1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self.channel = CallChannel(f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}",
                                   self.world_size, 0)
        self.port = free_port()
        self.group: TPGroup | None = None
        self.closed = False
        ctx = multiprocessing.get_context("spawn")
        # the parent-death signal fires when the spawning *thread* ends
        pdeathsig = threading.current_thread() is threading.main_thread()
        self.processes, self.doorbells = [], []
        # rank 0 alone samples: the features it alone runs stay there
        # (their options need not pickle)
        worker_config = config.derive(features=tuple(
            (name, options) for name, options in config.features
            if not REGISTRY.meta("feature", name).get("first_rank_only")))
        try:
            for rank in range(1, self.world_size):
                reader, writer = ctx.Pipe()  # duplex: collective_rpc's replies come back on it
                self.doorbells.append(writer)
                process = ctx.Process(target=worker_main, name=f"nanovllm-rank{rank}", daemon=True,
                                      args=(worker_config, rank, reader, self.channel.name,
                                            self.port, pdeathsig))
                process.start()
                reader.close()  # so that ringing a dead worker fails at once
                self.processes.append(process)
        except BaseException as e:
            self.close(graceful=False)
            if isinstance(e, RuntimeError) and "bootstrapping phase" in str(e):  # no __main__ guard
                raise RuntimeError("cannot start workers from a spawned process: "
                                   f"{MAIN_GUARD_HINT}") from e
            raise
        threading.Thread(target=self._watch, name="nanovllm-worker-watch", daemon=True).start()
        forget_in_forked_child(self, WorkerGroup.forget)

    def connect(self) -> TPGroup:
        self.group = TPGroup(0, self.world_size, self.port, self.config.device,
                             waiting=self._check_starting)
        return self.group

    def _check_starting(self):
        if dead := self.dead():
            rank, code = dead[0]
            raise WorkerDiedError(f"tensor-parallel worker rank {rank} exited (exit code {code}) "
                                  "before connecting (its error is above); if it failed while "
                                  f"importing: {MAIN_GUARD_HINT}")

    def _watch(self):
        """Aborts an NCCL group once a worker dies: its collectives would wait forever (gloo's
        raise)."""
        multiprocessing.connection.wait([p.sentinel for p in self.processes])
        if not self.closed and self.group is not None and self.config.device == "cuda":
            self.group.abort()

    def call(self, method: str, *args):
        """Every worker runs ``resolve(runner, method)(*args)`` (``reply``: rank 0 reads each
        one's result with ``replies``)."""
        if self.channel is None:
            raise RuntimeError("this engine's workers belong to the process that forked this one")
        moved = self.channel.write(dumps((method, args)), self.death_error)
        for doorbell in self.doorbells:
            try:
                doorbell.send_bytes(moved)
            except OSError:  # a broken pipe
                if error := self.death_error(JOIN_TIMEOUT_S):
                    raise error from None
                raise

    def replies(self, deadline: float | None) -> list[tuple[bool, object]]:
        """Every worker's reply to the last "reply" call, in rank order."""
        replies = []
        for rank, doorbell in enumerate(self.doorbells, 1):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not doorbell.poll(left):
                raise TimeoutError(f"tensor-parallel worker rank {rank} did not reply in time")
            try:
                replies.append(pickle.loads(doorbell.recv_bytes()))
            except (EOFError, OSError):
                raise self.death_error(JOIN_TIMEOUT_S) or WorkerDiedError(
                    f"worker rank {rank} died") from None
        return replies

    def dead(self) -> list[tuple[int, int | None]]:
        return [(rank, p.exitcode) for rank, p in enumerate(self.processes, 1) if not p.is_alive()]

    def death_error(self, wait_s: float = 0.0) -> WorkerDiedError | None:
        """The error naming a dead worker, or None, after waiting up to ``wait_s`` for one: a dying
        peer's sockets close a moment before its exit status can be read."""
        deadline = time.monotonic() + wait_s
        while not (dead := self.dead()) and (left := deadline - time.monotonic()) > 0:
            if not multiprocessing.connection.wait([p.sentinel for p in self.processes], left):
                break
            time.sleep(0.005)  # one has ended: its exit status follows
        if not dead:
            return None
        rank, code = dead[0]
        return WorkerDiedError(f"tensor-parallel worker rank {rank} died (exit code {code})")

    def close(self, graceful: bool):
        """Ends the workers: ``graceful`` (after a clean run) asks them to exit first; else they are
        killed at once, as waiting on a worker of unknown state could take forever."""
        if self.closed:
            return
        self.closed = True
        if graceful and not self.dead():
            with contextlib.suppress(Exception):
                self.call("exit")
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            for p in self.processes:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            p.kill()
        for p in self.processes:
            p.join()
        if self.group is not None and self.config.device == "cuda":
            self.group.abort()
        self.group = None
        for doorbell in self.doorbells:
            doorbell.close()
        self.channel.close()

    def forget(self):
        """In a forked child: the workers are the parent's, not to be called, ended or unlinked
        from here."""
        # else its exit handler ends them
        multiprocessing.process._children.difference_update(self.processes)
        self.closed, self.processes, self.doorbells, self.channel = True, [], [], None


def resolve(runner: ModelRunner, method) -> Callable:
    """What a call by name reaches on a rank: a function (given the runner first), a method of the
    runner's ``worker`` ("name"), or of one of its ``extensions`` ("owner.name")."""
    if callable(method):
        return functools.partial(method, runner)
    owner, _, name = method.rpartition(".")
    return getattr(runner.extensions[owner] if owner else runner.worker, name)


def reply(runner, method, args: tuple, kwargs: dict) -> bytes:
    """A worker's pickled reply to a call: (True, the result) or (False, its error)."""
    try:
        return dumps((True, resolve(runner, method)(*args, **kwargs)))
    except Exception as e:  # the method failed, or its result does not pickle
        return dumps((False, f"{type(e).__name__}: {e}"))


def call_every_rank(core, method, args: tuple = (), kwargs: dict | None = None,
                    deadline: float | None = None) -> list:
    """``resolve(runner, method)(*args, **kwargs)`` on every rank at once (the caller holds
    ``core.lock``); each rank's result, rank 0's first. A worker's failure is a RuntimeError naming
    its rank; a dead or late one shuts the engine down."""
    call, kwargs = (method, tuple(args), dict(kwargs or {})), dict(kwargs or {})
    core.resources.check_open()
    runner, workers = core.resources.runner, core.resources.workers
    if workers is not None:
        try:
            dumps(call)
        except Exception as e:
            raise TypeError(f"the method, args and kwargs of a call to every rank must pickle: "
                            f"{e}") from None
        core.call_or_shut_down(workers.call, "reply", *call)
    try:
        result = resolve(runner, method)(*args, **kwargs)
    finally:
        replies = core.call_or_shut_down(workers.replies, deadline) if workers else []
    for rank, (ok, value) in enumerate(replies, 1):
        if not ok:
            raise RuntimeError(f"tensor-parallel worker rank {rank} raised {value}")
    return [result, *(value for _, value in replies)]


def _exit_with_parent(pdeathsig: bool):
    """Ends this worker with rank 0's process, even when stuck in C code: Linux's parent-death
    SIGKILL, and a thread on the parent's sentinel."""
    if pdeathsig and sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if (parent := multiprocessing.parent_process()) is None:
        return
    if os.getppid() != parent.pid:
        os._exit(1)  # rank 0 died before the signal was armed

    def watch():
        parent.join()
        os._exit(1)
    threading.Thread(target=watch, name="nanovllm-parent-watch", daemon=True).start()


def worker_main(config: Config, rank: int, doorbell, segment: str, port: int, pdeathsig: bool):
    """A worker: builds its ModelRunner and runs rank 0's calls until "exit"; leaves by
    ``os._exit``, as an interpreter teardown could wait on a broken group."""
    _exit_with_parent(pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    code = 1
    try:
        # attached before joining the group: rank 0 writes nothing before every rank joined
        channel = CallChannel(segment, config.tensor_parallel_size, rank)
        group = TPGroup(rank, config.tensor_parallel_size, port, config.device)
        runner = ModelRunner(config, rank, group)
        while (call := channel.read(doorbell)) is not None:
            method, args = call
            if method == "reply":  # (method, args, kwargs), answered on the doorbell
                doorbell.send_bytes(reply(runner, *args))
            else:
                resolve(runner, method)(*args)
            if method == "exit":
                code = 0
                break
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass(eq=False)
class EngineResources:
    """The workers, their shared memory and the model runner, apart from the engine so that their
    finalizer does not keep it alive."""

    workers: WorkerGroup | None = None
    runner: ModelRunner | None = None
    # False once a step failed part-way: the ranks may disagree on where they are
    healthy: bool = True
    closed: bool = False

    def close(self):
        if self.closed:
            return
        self.closed = True
        runner, self.runner = self.runner, None
        try:
            if runner is not None and self.healthy:
                runner.exit()
        finally:
            if self.workers is not None:
                self.workers.close(graceful=self.healthy)

    def check_open(self) -> None:
        if self.closed:
            raise self.closed_error()

    @staticmethod
    def closed_error() -> RuntimeError:
        """The one error of every call after exit() or a failure."""
        return RuntimeError("the engine has been shut down (exit() or a failure); create a new LLM")

    def shut_down_and_raise(self, e: BaseException, shutdown):
        """Calls ``shutdown()`` and raises ``e``, or the ``WorkerDiedError`` of a worker that died
        (or soon dies)."""
        if not self.healthy:  # an inner call shut down already
            raise e
        self.healthy = False
        error = e
        if self.workers is not None and not isinstance(e, (WorkerDiedError, KeyboardInterrupt,
                                                           ValueError, TypeError)):
            error = self.workers.death_error(DEATH_GRACE_S) or e
        shutdown()
        if error is e:
            raise e
        raise error from e
