"""A grammar bitmask handed from its fill's thread to a sampler already launched, so that the host
launches the next step while a constrained step's bitmask is filled (one rank, async scheduling)."""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from nanovllm.kernels import triton_module

logger = logging.getLogger("nanovllm")


class BitmaskHandoff:
    """The sampler waits on the device (``triton_sampler.wait_for_flag``) for a flag in pinned host
    memory, then copies one pinned buffer; the fill writes the buffer, then raises the flag to its
    step's ticket (stored after the rows: x86 keeps stores in order). The host joins the fill before
    it waits on the device, ``open`` frees every wait at shutdown, and a wait that gave up is an
    error at the read-back. On the CPU the launch waits."""

    OPEN = 1 << 62  # the flag once nothing may wait any more

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.on_device = device.type == "cuda"
        words = (vocab_size + 31) // 32
        self.host = torch.empty((max_rows, words), dtype=torch.int32, pin_memory=self.on_device)
        self.rows = (torch.empty((max_rows, words), dtype=torch.int32, device=device)
                     if self.on_device else None)
        self.flag = torch.zeros(1, dtype=torch.int64, pin_memory=self.on_device)
        self._flag = self.flag.numpy()  # written without torch: one aligned 8-byte store
        # written by wait_for_flag
        self.gave_up = torch.zeros(1, dtype=torch.int64, pin_memory=self.on_device)
        self.lock = threading.Lock()  # publish (the fill's thread) against open (the engine's)
        self.ticket = 0

    @classmethod
    def create(cls, max_rows: int, vocab_size: int, device: torch.device) -> BitmaskHandoff | None:
        """A handoff whose device wait was tried once, or None where the device cannot wait for the
        host."""
        try:
            handoff = cls(max_rows, vocab_size, device)
            if handoff.on_device:
                ticket = handoff.reserve()
                handoff.publish(ticket)
                handoff.to_device(ticket, 1, None)
                torch.cuda.current_stream(device).synchronize()
                handoff.check(ticket)
            return handoff
        except Exception as e:  # no Triton, or a Triton that cannot read pinned host memory
            logger.warning("structured outputs: the sampler waits for each bitmask's fill on the "
                           "host (%s)", e)
            return None

    def reserve(self) -> int:
        self.ticket += 1
        return self.ticket

    def publish(self, ticket: int) -> None:
        """``ticket``'s fill has ended: the device may copy the buffer."""
        with self.lock:
            if ticket > self._flag[0]:
                self._flag[0] = ticket

    def open(self) -> None:
        """Frees every device wait (shutdown), and lets those launched end."""
        with self.lock:
            self._flag[0] = self.OPEN
        if self.on_device:
            # a failed device: nothing of ours waits on it any more
            with contextlib.suppress(Exception):
                torch.cuda.current_stream(self.rows.device).synchronize()

    def check(self, ticket: int) -> None:
        """Raises if the device's wait for ``ticket``'s fill gave up."""
        if self.on_device and self.gave_up[0] >= ticket:
            raise RuntimeError("the device stopped waiting for a structured-output bitmask: the "
                               "step's tokens were sampled without it")

    def to_device(self, ticket: int, num_rows: int, fill: Future | None) -> torch.Tensor:
        """The first ``num_rows`` rows for the sampler: on CUDA, copied once the flag reaches
        ``ticket`` (the host does not wait); on the CPU, ``fill``'s result."""
        if not self.on_device:
            return fill.result()
        triton_module("triton_sampler", None).wait_for_flag(self.flag, self.gave_up, ticket)
        return self.rows[:num_rows].copy_(self.host[:num_rows], non_blocking=True)


@dataclass(eq=False)
class PendingFill:
    """A fill the device waits for, in the step's output: ``wait`` (raising the fill's error) before
    the host waits on the device, ``check`` after."""

    fill: Future
    handoff: BitmaskHandoff
    ticket: int

    def wait(self) -> None:
        self.fill.result()

    def check(self) -> None:
        self.handoff.check(self.ticket)


@functools.cache
def background() -> ThreadPoolExecutor:
    """The one thread that fills bitmasks while the engine builds its next step."""
    return ThreadPoolExecutor(1, thread_name_prefix="nanovllm-fill")
