"""The engine core: the step loop under a lock, the requests, the step in flight, the resources."""
from __future__ import annotations

import logging
import threading

from nanovllm.config import Config
from nanovllm.engine import batch as step_inputs
from nanovllm.engine.outputs import ModelRunnerOutput, OutputProcessor, Request
from nanovllm.engine.sampling import LogitsHook, Penalties
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.worker_group import EngineResources

logger = logging.getLogger("nanovllm")


class EngineCore:
    """A step: schedule -> launch (arrays, forward, hooks, sample) -> read back (tokens, stops)."""

    def __init__(self, config: Config, resources: EngineResources, shutdown,
                 hooks: list[LogitsHook]):
        """``shutdown()`` frees ``resources``; ``hooks`` run after the penalties."""
        self.config, self.resources, self._free = config, resources, shutdown
        self.scheduler = Scheduler(config)
        self.outputs = OutputProcessor(config.eos_token_ids, config.max_model_len)
        self.hooks: list[LogitsHook] = [Penalties(), *hooks]
        self.requests: dict[int, Request] = {}  # the unfinished requests, by seq_id
        self.inflight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None  # not read back yet
        self.lock = threading.RLock()  # re-entered by a shutdown from inside a step
        self.progress: dict[str, str] = {}  # more of the progress bar's figures (verify steps')

    def step(self) -> int:
        """One step; returns the prefill tokens launched, or minus the decodes."""
        if self.resources.closed:
            raise self.resources.closed_error()
        return self.one_step()

    def normal_step(self) -> int:
        batch = self._schedule()
        output = self.launch(batch)
        self.inflight = (batch, output) if output is not None else None
        self.read_back()
        return batch.num_tokens

    one_step = normal_step  # OverlapEngineCore's: overlap_step

    def _schedule(self) -> SchedulerOutput:
        batch = self.scheduler.schedule()
        if not batch.seqs and self.inflight is None:
            raise RuntimeError("the scheduler found nothing to run and no forward is in flight")
        return batch

    def launch(self, batch: SchedulerOutput) -> ModelRunnerOutput | None:
        """Starts ``batch``; a sequence whose sampling inputs fail ends alone (None if all do)."""
        runner, errors = self.resources.runner, {}
        try:
            sampling = runner.prepare_sample(batch)
        except Exception:
            for seq in batch.seqs:
                try:
                    runner.prepare_sample(SchedulerOutput([seq], batch.is_prefill))
                except Exception as e:
                    errors[seq] = e
            if not errors:
                raise
            for seq, error in errors.items():
                self.end_with_error(seq, error)
            batch.drop(errors)
            sampling = runner.prepare_sample(batch) if batch.seqs else None
        if not batch.seqs:
            return None
        seqs, block_size = batch.seqs, self.config.kvcache_block_size
        prev = self.inflight[0] if self.inflight else None
        batch.step_input = (step_inputs.prepare_prefill(seqs, block_size) if batch.is_prefill
                            else step_inputs.prepare_decode(seqs, block_size, prev,
                                                            not self.config.disable_cascade_attn))
        if self.resources.workers is not None:
            self.call_or_shut_down(self.resources.workers.call, "run", batch.step_input)
        logits = self.call_or_shut_down(runner.forward, batch.step_input, sampling)
        self.scheduler.launched(batch)
        read_back = self.read_back if self.inflight else None
        for hook in self.hooks:
            self.call_or_shut_down(hook.prepare, batch, sampling, read_back)
        return self.call_or_shut_down(runner.sample, batch.step_input, logits, sampling)

    def read_back(self, after_accept=None) -> None:
        """Reads back the step in flight: hooks accept, ``after_accept(refused)``, then stops."""
        if self.inflight is None:
            return
        (batch, output), self.inflight = self.inflight, None
        workers = self.resources.workers  # with NCCL ranks, poll: a dead worker would never answer
        alive = (lambda: not workers.dead()) if workers and self.config.device == "cuda" else None
        advanced = self.scheduler.postprocess(batch, *self.call_or_shut_down(output.result, alive))
        errors = {seq: FloatingPointError("the model's logits were NaN or +inf (a fault in its "
                  "weights, their scales or the dtype)") for seq, t in advanced if t < 0}
        errors.update((seq, e) for hook in self.hooks for seq, e in hook.accept(advanced).items())
        if after_accept is not None:
            after_accept(errors.keys())
        for seq, token_id in advanced:
            try:
                if (error := errors.get(seq)) is not None:
                    raise error
                stop = self.outputs.check_stop(self.requests[seq.seq_id], seq, token_id)
            except Exception as e:  # its text failed to decode, or its grammar refused the token
                self.end_with_error(seq, e)
                continue
            if stop is not None:
                self._end(seq, *stop)

    def call_or_shut_down(self, fn, *args):
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
        request = self.requests[seq.seq_id]
        logger.warning("request %s, completion %d failed and was ended: %s: %s", request.request_id,
                       request.seqs.index(seq), type(error).__name__, error)
        request.error = f"{type(error).__name__}: {error}"
        self._end(seq, "error")
        self.outputs.stream_piece(request, seq, "", [])

    def abort(self, request: Request):
        """Ends its unfinished completions ("abort") and forgets it; the caller holds the lock."""
        for seq in request.seqs:
            if not seq.is_finished:
                self._end(seq, "abort")
        self.forget(request)

    def forget(self, request: Request):
        for seq in request.seqs:
            self.requests.pop(seq.seq_id, None)

    def release(self, requests: list[Request]):
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
        with self.lock:
            if self.is_finished():
                return 0
            try:
                return self.step()
            except KeyboardInterrupt:
                self.shutdown()
                raise

    def drain_if_idle(self):
        with self.lock:
            if self.inflight and self.scheduler.is_finished() and not self.resources.closed:
                self.step()

    def shutdown(self):
        """Frees the resources once no step uses them, first letting go of any device wait."""
        for hook in self.hooks:
            hook.shutdown()
        with self.lock:  # another thread's step ends first; its caller then gets the shut-down
            self._free()
