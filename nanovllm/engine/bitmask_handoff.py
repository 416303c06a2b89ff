"""The grammar bitmask's handoff from a host thread to the device's sampler, so that the host builds and launches
the next step while a constrained step's bitmask is filled (one rank, async scheduling)."""
from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

logger = logging.getLogger("nanovllm")


class BitmaskHandoff:
    """A step's bitmask on its way to the sampler while the host goes on: the sampler is launched at once, behind
    a device wait for a flag in pinned host memory (``triton_sampler.wait_for_flag``) and a copy of one pinned
    buffer; the fill, in a thread, writes the buffer, then raises the flag to the step's ticket. The host never
    blocks on the device while the device waits (``PendingFill.wait`` comes first), ``open`` frees every wait at
    shutdown, and a wait that gave up is an error at the read-back. The flag is stored after the rows; x86 keeps
    stores in order. On the CPU the launch waits for the fill instead."""

    OPEN = 1 << 62  # the flag's value once nothing may wait any more

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.on_device = device.type == "cuda"
        words = (vocab_size + 31) // 32
        self.host = torch.empty((max_rows, words), dtype=torch.int32, pin_memory=self.on_device)
        self.rows = torch.empty((max_rows, words), dtype=torch.int32, device=device) if self.on_device else None
        self.flag = torch.zeros(1, dtype=torch.int64, pin_memory=self.on_device)
        self._flag = self.flag.numpy()  # written without torch: one aligned 8-byte store
        self.gave_up = torch.zeros(1, dtype=torch.int64, pin_memory=self.on_device)  # by the device: wait_for_flag
        self.lock = threading.Lock()  # publish (the fill's thread) against open (the engine's)
        self.ticket = 0

    @classmethod
    def create(cls, max_rows: int, vocab_size: int, device: torch.device) -> BitmaskHandoff | None:
        """A handoff whose device wait has been checked once, or None where the device cannot wait for the host."""
        try:
            handoff = cls(max_rows, vocab_size, device)
            if handoff.on_device:
                ticket = handoff.reserve()
                handoff.publish(ticket)
                handoff.to_device(ticket, 1, None)
                torch.cuda.current_stream(device).synchronize()
                handoff.check(ticket)
            return handoff
        except Exception as e:  # ImportError (no Triton), or a Triton that cannot read pinned host memory
            logger.warning("structured outputs: the sampler waits for each bitmask's fill on the host (%s)", e)
            return None

    def reserve(self) -> int:
        """The next step's ticket (before its fill starts)."""
        self.ticket += 1
        return self.ticket

    def publish(self, ticket: int) -> None:
        """The fill of ``ticket``'s buffer has ended: the device may copy it (from the fill's thread)."""
        with self.lock:
            if ticket > self._flag[0]:
                self._flag[0] = ticket

    def open(self) -> None:
        """No device wait holds from now on (shutdown); those launched end before the flag's memory is reused."""
        with self.lock:
            self._flag[0] = self.OPEN
        if self.on_device:
            try:
                torch.cuda.current_stream(self.rows.device).synchronize()
            except Exception:  # a device that failed: nothing of ours waits on it any more
                pass

    def check(self, ticket: int) -> None:
        """Raises if the device's wait for ``ticket``'s fill gave up (after the step's tokens were read back)."""
        if self.on_device and self.gave_up[0] >= ticket:
            raise RuntimeError("the device stopped waiting for a structured-output bitmask (its fill did not end "
                               "within triton_sampler.MAX_POLLS polls of the flag): the step's tokens were sampled "
                               "without it")

    def to_device(self, ticket: int, num_rows: int, fill: Future | None) -> torch.Tensor:
        """The bitmask's first ``num_rows`` rows for the sampler: on CUDA, the device copy of the buffer, made once
        the flag reaches ``ticket`` (the host does not wait); on the CPU, ``fill``'s bitmask, once it is done."""
        if not self.on_device:
            return fill.result()
        from nanovllm.kernels import triton_sampler
        triton_sampler.wait_for_flag(self.flag, self.gave_up, ticket)
        return self.rows[:num_rows].copy_(self.host[:num_rows], non_blocking=True)


class PendingFill:
    """A bitmask fill the device waits for, as the step's output sees it: ``wait`` before the host waits on the
    device (raising the fill's error), ``check`` after."""

    def __init__(self, fill: Future, handoff: BitmaskHandoff, ticket: int):
        self.fill, self.handoff, self.ticket = fill, handoff, ticket

    def wait(self) -> None:
        self.fill.result()

    def check(self) -> None:
        self.handoff.check(self.ticket)


@functools.cache
def background() -> ThreadPoolExecutor:
    """The thread that fills a bitmask while the engine builds its next step (one for the process)."""
    return ThreadPoolExecutor(1, thread_name_prefix="nanovllm-fill")
