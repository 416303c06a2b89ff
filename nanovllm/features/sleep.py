"""Sleep mode, a feature with vLLM's semantics: ``LLM(enable_sleep_mode=True)``; ``sleep(level=1)``
copies the weights to host memory (pinned on CUDA) and discards the KV cache, ``sleep(level=2)``
discards both; ``wake_up(tags)`` takes back the device memory of ``"weights"`` and/or ``"kv_cache"``
(all when None). Between the two, the trainer has the device: an RL loop sleeps while it trains and
wakes to generate.

Memory is given back by resizing each weight storage and the KV cache's storage to zero bytes (then
``torch.cuda.empty_cache``); every parameter, view and layer's ``k_cache``/``v_cache`` keeps its
tensor, so waking resizes the same storages back and nothing else in the engine changes. The new
memory has new addresses: the CUDA graphs are dropped at ``sleep`` and captured again once both
tags are awake. After level 2 the weights wake zeroed, to be loaded with ``update_weights`` (or a
``collective_rpc`` method of a ``worker_extension_cls``) before generating. Requests are refused
while anything is asleep; ``sleep`` is refused while requests are unfinished."""
from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from nanovllm.engine.worker_group import call_every_rank
from nanovllm.plugins import Feature
from nanovllm.sampling_params import check_int

logger = logging.getLogger("nanovllm")
TAGS = ("weights", "kv_cache")


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """``storage`` as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class RunnerSleep:
    """One rank's sleep state: what is asleep, and the weights' host copies (level 1)."""

    def __init__(self, runner):
        self.runner = runner
        self.asleep: set[str] = set()
        # tag -> its storages and their byte sizes when awake (asleep, they are empty: no address
        # tells them apart)
        self.freed: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        # level 1: the weight storages' bytes, one after another
        self.host: torch.Tensor | None = None
        self.timings: dict[str, float] = {}  # the last wake_up's phases, in seconds

    def storages(self, tag: str) -> list[torch.UntypedStorage]:
        """The storages ``tag`` frees: each parameter's once (tied ones share theirs), or the KV
        cache's."""
        if tag == "kv_cache":
            return [self.runner.kv_cache.untyped_storage()]
        unique = {}
        for param in self.runner.model.parameters():
            unique.setdefault((param.device, param.untyped_storage().data_ptr()),
                              param.untyped_storage())
        return list(unique.values())

    def sleep(self, level: int):
        runner = self.runner
        if runner.is_cuda:
            torch.cuda.synchronize(runner.device)  # a step launched last may still read them
        runner.graphs = None  # their captured addresses are about to go
        if "weights" not in self.asleep:
            storages = self.storages("weights")
            if level == 1:  # one pinned buffer: one host allocation, copies at the link's rate
                pin = runner.is_cuda
                self.host = torch.empty(sum(s.nbytes() for s in storages), dtype=torch.uint8,
                                        pin_memory=pin)
                for host, storage in zip(self._host_parts(storages), storages):
                    host.copy_(_bytes(storage), non_blocking=pin)
                if pin:
                    torch.cuda.synchronize(runner.device)
            self._free("weights", storages)
        if "kv_cache" not in self.asleep:
            self._free("kv_cache", self.storages("kv_cache"))
        gc.collect()  # the dropped graphs and their memory pool
        if runner.is_cuda:
            torch.cuda.empty_cache()

    def _free(self, tag: str, storages: list[torch.UntypedStorage]):
        self.freed[tag] = [(storage, storage.nbytes()) for storage in storages]
        for storage in storages:
            storage.resize_(0)
        self.asleep.add(tag)

    def _host_parts(self, storages: list[torch.UntypedStorage]) -> list[torch.Tensor]:
        """The slices of the host buffer that hold each storage's bytes."""
        return list(torch.split(self.host, [s.nbytes() for s in storages]))

    def wake_up(self, tags: list[str]):
        """Takes back ``tags``' memory. The weights' upload (a side stream on CUDA) overlaps the
        capture of the CUDA graphs, which records addresses, not values: the capture's warm-up
        forwards may read weights still on the way and write what they make into the KV cache, so
        the cache is zeroed once the upload is done."""
        runner, start = self.runner, time.perf_counter()
        waking = [t for t in TAGS if t in tags and t in self.asleep]
        storages = {}
        for tag in waking:
            storages[tag] = [storage for storage, _ in self.freed[tag]]
            for storage, size in self.freed.pop(tag):
                storage.resize_(size)
            self.asleep.discard(tag)
        self.timings = {"allocate": time.perf_counter() - start}
        upload = torch.cuda.Stream(runner.device) if runner.is_cuda else None
        if "weights" in storages and self.host is not None:
            if upload is not None:
                # the memory resize_ allocated
                upload.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(upload) if upload is not None else contextlib.nullcontext():
                for host, storage in zip(self._host_parts(storages["weights"]),
                                         storages["weights"]):
                    _bytes(storage).copy_(host, non_blocking=upload is not None)
        elif "weights" in storages:  # level 2: zeros, to be loaded
            for storage in storages["weights"]:
                _bytes(storage).zero_()
            if runner.rank == 0:
                logger.info("wake_up: the weights were discarded (sleep level 2) and are zeros: "
                            "load them with update_weights() before generating")
        captured = (not self.asleep and runner.is_cuda and not runner.config.enforce_eager
                    and runner.graphs is None)
        if captured:
            mark = time.perf_counter()
            with runner.building():
                runner.capture_cudagraph()
            self.timings["capture"] = time.perf_counter() - mark
        if upload is not None:
            torch.cuda.current_stream(runner.device).wait_stream(upload)
        # zeros: masked-out positions must not hold NaN patterns
        if "kv_cache" in storages or captured:
            _bytes(runner.kv_cache.untyped_storage()).zero_()
        if runner.is_cuda:
            torch.cuda.synchronize(runner.device)
        if "weights" in storages:
            self.host = None
        self.timings["total"] = time.perf_counter() - start


def check_tags(tags) -> list[str]:
    """``wake_up``'s tags as a list (None: all); a ValueError names an unknown one."""
    if tags is None:
        return list(TAGS)
    if isinstance(tags, str) or not isinstance(tags, (list, tuple, set)):
        raise TypeError(f"tags must be None or a list of {list(TAGS)}, got {tags!r:.80}")
    if bad := [t for t in tags if t not in TAGS]:
        raise ValueError(f"wake_up: unknown tag(s) {bad!r}; the tags are {list(TAGS)}")
    return list(tags)


def _require_sleep_mode(engine, what: str):
    if "sleep" not in engine.features:
        raise ValueError(f"{what} needs sleep mode: create the LLM with enable_sleep_mode=True")


def check_awake(runner, what: str, tags=TAGS):
    """A RuntimeError when any of ``tags`` is asleep on ``runner`` (rank 0's mirrors every
    rank's)."""
    state = runner.extensions.get("sleep") if runner is not None else None
    if state is not None and (asleep := [t for t in TAGS if t in tags and t in state.asleep]):
        raise RuntimeError(f"{what} while the engine sleeps ({' and '.join(asleep)} asleep): call "
                           f"wake_up({'' if len(asleep) > 1 else f'tags={asleep!r}'}) first")


def sleep(engine, level: int = 1):
    """``LLM.sleep``: every rank gives its KV cache and weights back (level 1 keeps the weights on
    the host); the prefix cache forgets everything. Refused while requests are unfinished."""
    check_int("level", level, lo=1, hi=2)
    _require_sleep_mode(engine, "sleep()")
    if is_sleeping(engine):  # vLLM's: a second sleep changes nothing (and loses no weights)
        logger.warning("sleep(level=%d): the engine is already sleeping; wake_up() first", level)
        return
    engine.core.drain_if_idle()
    with engine.core.lock:
        if not engine.core.is_finished():
            scheduler = engine.core.scheduler
            raise ValueError(f"sleep() while {len(scheduler.waiting) + len(scheduler.running)} "
                             "completions are unfinished: let them finish or abort them first")
        call_every_rank(engine.core, "sleep.sleep", (level,))
        engine.core.scheduler.block_manager.reset_prefix_cache()


def wake_up(engine, tags: list[str] | None = None):
    """``LLM.wake_up``: ``tags`` (None: both) take their device memory back on every rank; once
    both are awake, CUDA graphs are captured again."""
    tags = check_tags(tags)
    _require_sleep_mode(engine, "wake_up()")
    with engine.core.lock:
        call_every_rank(engine.core, "sleep.wake_up", (tags,))


def is_sleeping(engine) -> bool:
    state = engine.model_runner and engine.model_runner.extensions.get("sleep")
    return bool(state and state.asleep)


class Sleep(Feature):
    """The feature (``enable_sleep_mode=True``): each rank's ``RunnerSleep`` as its "sleep"
    extension; requests are refused while anything sleeps."""

    def setup_runner(self, runner) -> None:
        runner.extensions["sleep"] = RunnerSleep(runner)

    def check_request(self, params, engine) -> None:
        check_awake(engine.model_runner, "a request")
