"""The engine core: the step loops (schedule -> forward -> logits hooks -> sample -> postprocess)
under a lock, the requests, the step in flight (async scheduling reads it back after launching the
next) and the resources."""
from __future__ import annotations

import logging
import threading

from nanovllm.config import Config
from nanovllm.engine import batch as step_inputs
from nanovllm.engine.outputs import ModelRunnerOutput, OutputProcessor, Request
from nanovllm.engine.sampling import LogitsHook, Penalties, SamplingInputs
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.worker_group import EngineResources

logger = logging.getLogger("nanovllm")


class EngineCore:
    """The step loop over the scheduler, the runners and the logits hooks, under ``lock``. A step is
    schedule -> launch (batch arrays, forward, hooks, sample) -> read back (tokens appended, stops).
    ``normal_step`` reads each step back at once; ``overlap_step`` (async scheduling) launches step
    N+1 before it reads step N back, so that the host's work overlaps the device's."""

    def __init__(self, config: Config, resources: EngineResources, shutdown,
                 hooks: list[LogitsHook]):
        """``shutdown()`` frees ``resources``; ``hooks`` run after the penalties."""
        self.config, self.resources, self._free = config, resources, shutdown
        self.scheduler = Scheduler(config)
        self.outputs = OutputProcessor(config.eos_token_ids, config.max_model_len)
        self.hooks: list[LogitsHook] = [Penalties(), *hooks]
        self.requests: dict[int, Request] = {}  # the unfinished requests, by seq_id
        # the step launched and not yet read back
        self.inflight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.lock = threading.Lock()

    def step(self) -> int:
        """One step; returns the prefill tokens launched, or minus the decodes."""
        if self.resources.closed:
            raise RuntimeError("the engine has been shut down (exit() or a failure); create a new LLM")
        return self.overlap_step() if self.config.async_scheduling else self.normal_step()

    def normal_step(self) -> int:
        batch = self._schedule()
        output = self.launch(batch)
        self.inflight = (batch, output) if output is not None else None
        self.read_back()
        return self._count(batch)

    def overlap_step(self) -> int:
        batch = self._schedule()
        if batch.seqs and self.inflight and any(h.needs_known_tokens(batch) for h in self.hooks):
            self.read_back()  # penalties read every known token
            batch = batch.without([seq for seq in batch.seqs if seq.is_finished])
        output = self.launch(batch) if batch.seqs else None
        self.read_back()
        self.inflight = (batch, output) if output is not None else None
        return self._count(batch)

    def _schedule(self) -> SchedulerOutput:
        batch = self.scheduler.schedule()
        if not batch.seqs and self.inflight is None:
            raise RuntimeError("the scheduler found nothing to run and no forward is in flight")
        return batch

    @staticmethod
    def _count(batch: SchedulerOutput) -> int:
        if batch.is_prefill:
            return sum(seq.num_scheduled_tokens for seq in batch.seqs)
        return -len(batch.seqs)

    def launch(self, batch: SchedulerOutput) -> ModelRunnerOutput | None:
        """Builds ``batch``'s arrays, starts the forward on every rank, then the sampler; None when
        every sequence of it failed its sampling inputs."""
        batch, sampling = self._prepare_sample(batch)
        if not batch.seqs:
            return None
        batch.step_input = self._step_input(batch)
        logits = self.call_or_shut_down(self._forward, batch.step_input, sampling)
        self.scheduler.launched(batch)
        read_back = self.read_back if self.inflight else None
        for hook in self.hooks:
            self.call_or_shut_down(hook.prepare, batch, sampling, read_back)
        return self.call_or_shut_down(self.resources.runner.sample, batch.step_input, logits,
                                      sampling)

    def read_back(self, after_accept=None) -> None:
        """Appends the step in flight's tokens; the hooks follow them, then
        ``after_accept(refused)`` runs, then the stopped sequences end."""
        if self.inflight is None:
            return
        (batch, output), self.inflight = self.inflight, None
        workers = self.resources.workers  # with NCCL ranks the read-back polls: a dead worker
        alive = (lambda: not workers.dead()) if workers and self.config.device == "cuda" else None
        token_ids, logprobs, prompt_logprobs = self.call_or_shut_down(output.result, alive)
        advanced = self.scheduler.postprocess(batch, token_ids, logprobs, prompt_logprobs)
        errors: dict[Sequence, Exception] = {}
        for hook in self.hooks:
            errors.update(hook.accept(advanced))
        if after_accept is not None:
            after_accept(errors.keys())
        for seq, token_id in advanced:
            self._check_stop(seq, token_id, errors.get(seq))

    def _check_stop(self, seq: Sequence, token_id: int, error: Exception | None):
        request = self.requests[seq.seq_id]
        try:
            if error is not None:
                raise error
            stop = self.outputs.check_stop(request, seq, token_id)
        except Exception as e:  # its text failed to decode, or its grammar refused the token
            self.end_with_error(seq, e)
            return
        if stop is not None:
            self._end(seq, *stop)

    def _step_input(self, batch: SchedulerOutput) -> step_inputs.StepInput:
        block_size = self.config.kvcache_block_size
        if batch.is_prefill:
            return step_inputs.prepare_prefill(batch.seqs, block_size)
        return step_inputs.prepare_decode(batch.seqs, block_size, self.inflight[0] if self.inflight else None)

    def _forward(self, step: step_inputs.StepInput, sampling: SamplingInputs):
        if self.resources.workers is not None:
            self.resources.workers.call("run", step)
        return self.resources.runner.forward(step, sampling)

    def _prepare_sample(self, batch: SchedulerOutput):
        """Rank 0's sampling inputs, before any rank starts: a sequence whose own parameters fail
        is ended alone."""
        runner = self.resources.runner
        try:
            return batch, runner.prepare_sample(batch)
        except Exception:
            errors = {}
            for seq in batch.seqs:
                try:
                    runner.prepare_sample(SchedulerOutput([seq], batch.is_prefill))
                except Exception as e:
                    errors[seq] = e
            if not errors:
                raise
        for seq, error in errors.items():
            self.end_with_error(seq, error)
        batch = batch.without(errors)
        return batch, runner.prepare_sample(batch) if batch.seqs else None

    def call_or_shut_down(self, fn, *args):
        """``fn(*args)``; a failure part-way (a dead worker, Ctrl-C) shuts the engine down."""
        try:
            return fn(*args)
        except BaseException as e:
            self.resources.shut_down_and_raise(e, self.shutdown)

    def add(self, request: Request, params):  # params: the request's checked SamplingParams
        with self.lock:
            for hook in self.hooks:
                hook.add(request.seqs, params)
            self.requests.update((seq.seq_id, request) for seq in request.seqs)
            self.scheduler.add(request.seqs[0], request.seqs[1:])

    def _end(self, seq: Sequence, reason: str, stop_reason: int | str | None = None):
        self.scheduler.finish(seq, reason, stop_reason)
        for hook in (*self.hooks, self.resources.runner.sampling):
            hook.forget(seq)

    def end_with_error(self, seq: Sequence, error: Exception):
        """Ends ``seq`` alone, for a failure of its own (its text, its sampling inputs)."""
        request = self.requests[seq.seq_id]
        logger.warning("request %s, completion %d failed and was ended: %s: %s", request.request_id,
                       request.seqs.index(seq), type(error).__name__, error)
        request.error = f"{type(error).__name__}: {error}"
        self._end(seq, "error")
        self.outputs.stream_piece(request, seq, "", [])

    def abort(self, request: Request):
        """Ends the request's unfinished completions ("abort") and forgets it; the caller holds the lock."""
        for seq in request.seqs:
            if not seq.is_finished:
                self._end(seq, "abort")
        self.forget(request)

    def forget(self, request: Request):
        for seq in request.seqs:
            self.requests.pop(seq.seq_id, None)

    def release(self, requests: list[Request]):
        """At the end of a generate/stream call: forgets its requests, aborting the unfinished ones."""
        with self.lock:
            for request in requests:
                if request.finished or self.resources.closed:
                    self.forget(request)
                else:
                    self.abort(request)
        self.drain_if_idle()

    def is_finished(self) -> bool:  # nothing waiting, running or in flight
        return self.scheduler.is_finished() and self.inflight is None

    def interruptible_step(self) -> int:
        """``step`` under the lock, unless another thread's step left nothing to do; Ctrl-C shuts
        down first."""
        with self.lock:
            if self.is_finished():
                return 0
            try:
                return self.step()
            except KeyboardInterrupt:
                self.shutdown()
                raise

    def drain_if_idle(self):
        """Reads back the step async scheduling leaves in flight once nothing else is left."""
        with self.lock:
            if self.inflight is not None and self.scheduler.is_finished() and not self.resources.closed:
                self.step()

    def shutdown(self):
        """Frees the resources, first letting go of any device wait on the host."""
        for hook in self.hooks:
            hook.shutdown()
        self._free()
