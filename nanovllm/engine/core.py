"""The engine core: the step loop (schedule -> launch -> read back) and what it owns: the requests, the
step in flight, the ranks' resources. With async scheduling the next step is launched before the one in
flight is read back; run synchronously, each step is read back at once. Every step runs under the core's
lock, so the API's calls from several threads take turns."""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter

from nanovllm.config import Config
from nanovllm.engine import batch
from nanovllm.engine.model_runner import ModelRunner, SamplingInputs
from nanovllm.engine.outputs import SampledTokens
from nanovllm.engine.scheduler import ScheduledStep, Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.structured_output import BitmaskHandoff, HandedOff, StructuredOutputManager, accept_tokens
from nanovllm.engine.worker_group import WorkerDiedError, WorkerGroup

logger = logging.getLogger("nanovllm")
# a peer's sockets close (and a collective fails) a moment before its exit status can be read
DEATH_GRACE_S = 3.0


@dataclass
class Request:
    """One prompt and its ``n`` completions (sequences); completion 0 is prefilled first and the
    others wait for it, so that they find the prompt's blocks in the prefix cache."""

    index: int
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    request_id: str = ""
    prompt: str | None = None        # the prompt's text, when it was given as text
    waiting_siblings: list[Sequence] = field(default_factory=list)
    stream: deque | None = None      # the pieces its stream() call has not yielded yet
    incremental_text: bool = False   # its outputs' text is its detokenizers' (add_request's: step() reports it often)
    num_reported: int = 0            # completion tokens step() has reported (add_request's requests)
    error: str | None = None         # why a completion ended with finish_reason "error"

    @property
    def finished(self) -> bool:
        return not self.waiting_siblings and all(seq.is_finished for seq in self.seqs)


class Resources:
    """What an engine holds beyond Python objects: the worker processes, their shared memory, the model
    runner and its device memory. Kept apart from the engine, so that the finalizer that frees them
    (``weakref.finalize``: on ``exit()``, when the engine is garbage-collected, or at interpreter exit)
    does not keep the engine alive."""

    def __init__(self):
        self.workers: WorkerGroup | None = None
        self.runner: ModelRunner | None = None
        self.healthy = True   # False once a step failed part-way: the ranks may disagree on where they are
        self.closed = False

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

    def fail(self, e: BaseException, shutdown):
        """After a failure part-way (start-up, a step): marks the ranks out of step, shuts the engine down
        (``shutdown``) and raises ``e``, or the ``WorkerDiedError`` naming a worker that died (or dies within
        a moment: its sockets close before its exit status is known)."""
        self.healthy = False
        error = e
        if self.workers is not None and not isinstance(e, (WorkerDiedError, KeyboardInterrupt, ValueError, TypeError)):
            error = self.workers.death_error(DEATH_GRACE_S) or e
        shutdown()
        if error is e:
            raise e
        raise error from e


class EngineCore:
    def __init__(self, config: Config, resources: Resources, shutdown,
                 structured_outputs: StructuredOutputManager | None = None):
        """``shutdown()`` frees ``resources`` (the engine's finalizer); ``structured_outputs`` fills the bitmasks
        of constrained sequences (those with a ``Sequence.grammar``)."""
        self.config, self.resources, self._free = config, resources, shutdown
        self.structured_outputs = structured_outputs
        # True: a constrained step's bitmask is filled while the device runs its forward (_launch_constrained);
        # False: such a decode batch waits for the step in flight before it is built, as penalty batches do
        # (kept to measure what the overlap buys: tools/bench_structured.py --no-overlap)
        self.overlap_grammar_bitmask = True
        # True (one rank, async scheduling): the bitmask is filled in a thread while the host builds the next step,
        # and the constrained step's sampler launched at once, behind the device's wait for that fill
        # (BitmaskHandoff); False: filled, then the sampler launched, before the next step is built
        # (tools/bench_structured.py --no-deferred-sampler)
        self.defer_grammar_sampler = True
        self.handoff: BitmaskHandoff | None | bool = None  # made on the first deferred fill (False: cannot be)
        self.scheduler = Scheduler(config)
        self.requests: dict[int, Request] = {}   # the unfinished requests, by the seq_id of each sequence
        self.inflight: tuple[ScheduledStep, SampledTokens] | None = None  # launched, result not yet read
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.eos_token_id = config.eos_token_ids[0] if config.eos_token_ids else None  # the model's own
        self.lock = threading.Lock()  # one step (or request admission) at a time

    def shutdown(self):
        """Frees the engine's resources, letting go first of a device wait for a bitmask (``BitmaskHandoff``)."""
        if self.handoff:
            self.handoff.open()
        self._free()

    def add(self, request: Request):
        with self.lock:
            self.requests.update((seq.seq_id, request) for seq in request.seqs)
            self.scheduler.add(request.seqs[0])

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self.inflight is None

    def step(self) -> tuple[list[Sequence], int]:
        """Schedules and launches one forward, and reads back the results of the one before it
        (async scheduling) or of this one. Returns the sequences whose results were read (or that
        ended) and the tokens launched (positive: prefill tokens; negative: decoded sequences)."""
        if self.resources.closed:
            raise RuntimeError("the engine has been shut down (exit() or a failure); create a new LLM")
        seqs, is_prefill = self.scheduler.schedule()
        done: list[Sequence] = []
        # penalties read every generated token, so such a decode batch waits for the step in flight (which
        # may finish some of its sequences); a prefill never has a token in flight
        if seqs and not is_prefill and self.inflight is not None and any(
                seq.sampling_params.needs_penalties or seq.grammar is not None and not self.overlap_grammar_bitmask
                for seq in seqs):
            self._finish_inflight(done)
            seqs = [seq for seq in seqs if not seq.is_finished]
        sampling = None
        if seqs:
            seqs, sampling = self._prepare_sampling(seqs, is_prefill, done)
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        launched = None
        if seqs:
            block_size = self.config.kvcache_block_size
            step = batch.build_prefill(seqs, block_size) if is_prefill else \
                batch.build_decode(seqs, block_size, self.inflight and self.inflight[0])
            if any(seq.grammar is not None for seq in seqs):
                launched = self._launch_constrained(step, seqs, is_prefill, sampling, done)
            else:
                output = self.guarded(self._launch, step, sampling)
                launched = self.scheduler.launched(seqs, is_prefill), output
        elif self.inflight is None and not done:
            raise RuntimeError("the scheduler found nothing to run and no forward is in flight")
        if self.inflight is not None:
            self._finish_inflight(done)
        self.inflight = launched
        if not self.config.async_scheduling and launched is not None:
            self._finish_inflight(done)
        return done, num_tokens

    def interruptible_step(self) -> tuple[list[Sequence], int]:
        """``step`` under the lock, unless another thread's step finished all there was to do; Ctrl-C
        shuts the engine down (processes, shared memory) before it propagates."""
        with self.lock:
            if self.is_finished():
                return [], 0
            try:
                return self.step()
            except KeyboardInterrupt:
                self.shutdown()
                raise

    def drain_if_idle(self):
        """Reads back a step still in flight once nothing else is left to do, so that an idle engine holds
        no forward (async scheduling leaves one behind the last token)."""
        with self.lock:
            if self.inflight is not None and self.scheduler.is_finished() and not self.resources.closed:
                self.step()

    def guarded(self, fn, *args):
        """``fn(*args)`` (a forward on every rank, or reading one's result); a failure part-way (a dead
        worker, Ctrl-C) shuts the engine down, and a dead worker is named."""
        try:
            return fn(*args)
        except BaseException as e:
            self.resources.fail(e, self.shutdown)

    def _launch(self, step: batch.StepInput, sampling: SamplingInputs) -> SampledTokens:
        if self.resources.workers is not None:
            self.resources.workers.call("run", step)
        return self.resources.runner.run(step, sampling)

    def _launch_constrained(self, step: batch.StepInput, seqs: list[Sequence], is_prefill: bool,
                            sampling: SamplingInputs, done: list[Sequence]) -> tuple[ScheduledStep, SampledTokens]:
        """Launches a step with constrained sequences. Their bitmask needs every known token, so when one of
        them has its token in the step in flight (async scheduling), the forward is launched first, the step in
        flight is read back (its tokens advance the matchers) while the device runs it, and the bitmask is
        filled and the sampler launched after: the device waits only if that host work outlasts the forward. On
        one rank (``defer_grammar_sampler``) the fill goes to a thread and the sampler is launched at once, the
        device waiting for the fill (``BitmaskHandoff``), so that the next step is built and launched meanwhile."""
        rows = [row for row, seq in enumerate(seqs) if seq.num_cached_tokens + seq.num_scheduled_tokens
                == seq.num_tokens]  # the rows whose sampled token is kept (Scheduler.launched's)
        pin = self.config.device == "cuda"
        fill = self.structured_outputs.grammar_bitmask  # (a failure there is the engine's: guarded)
        if self.inflight is None or not any(seqs[row].grammar is not None and seqs[row].num_pending_tokens
                                            for row in rows):
            if self.inflight is not None and self.inflight[1].waits_for is not None:
                self.guarded(self.inflight[1].waits_for.wait)  # one fill at a time (they share xgrammar's pool)
            sampling.token_bitmask = self.guarded(fill, seqs, rows, pin)
            output = self.guarded(self._launch, step, sampling)
            return self.scheduler.launched(seqs, is_prefill), output
        forward = self.guarded(self._launch_forward, step, sampling)
        scheduled = self.scheduler.launched(seqs, is_prefill)
        handoff = self._bitmask_handoff(len(seqs))
        if handoff is None:
            self._finish_inflight(done)
            sampling.token_bitmask = self.guarded(fill, seqs, rows, pin)
            return scheduled, self.guarded(self.resources.runner.sample, step, forward, sampling)
        # the fill starts in a thread once the matchers have their tokens, before the stop checks, and raises the
        # handoff's flag to this step's ticket when it ends
        ticket, started = handoff.reserve(), []
        self._finish_inflight(done, lambda refused: started.append(self.guarded(
            self.structured_outputs.grammar_bitmask_async, seqs, rows, pin, refused, handoff.host,
            lambda: handoff.publish(ticket))))
        if started[0] is not None:
            sampling.token_bitmask = self.guarded(handoff.to_device, ticket, len(seqs), started[0])
        output = self.guarded(self.resources.runner.sample, step, forward, sampling)
        if started[0] is not None:
            output.waits_for = HandedOff(started[0], handoff, ticket)
        return scheduled, output

    def _bitmask_handoff(self, num_rows: int) -> BitmaskHandoff | None:
        """The handoff for a step of ``num_rows`` sequences, or None where the sampler must wait for the fill: not
        ``defer_grammar_sampler``, under TP (the workers would wait in the sampler's broadcast meanwhile, which has
        not been measured), or where the device cannot wait for the host."""
        if not self.defer_grammar_sampler or self.resources.workers is not None:
            return None
        if self.handoff is None:
            self.handoff = BitmaskHandoff.create(self.config.max_num_seqs, self.structured_outputs.vocab_size,
                                                 self.resources.runner.device) or False
        return self.handoff if self.handoff and num_rows <= self.handoff.host.size(0) else None

    def _launch_forward(self, step: batch.StepInput, sampling: SamplingInputs):
        """``_launch`` up to the logits: the workers run the whole step (they do not sample)."""
        if self.resources.workers is not None:
            self.resources.workers.call("run", step)
        return self.resources.runner.forward(step, sampling)

    def _prepare_sampling(self, seqs: list[Sequence], is_prefill: bool, done: list[Sequence]):
        """Rank 0's sampling inputs, built before any rank starts the step: a sequence whose own
        parameters make this fail is ended alone (``fail``) and the step goes on without it."""
        runner = self.resources.runner
        try:
            return seqs, runner.prepare_sampling(seqs, is_prefill)
        except Exception:
            errors = {}
            for seq in seqs:
                try:
                    runner.prepare_sampling([seq], is_prefill)
                except Exception as e:
                    errors[seq] = e
            if not errors:
                raise
        for seq, error in errors.items():
            self.fail(seq, error)
        done.extend(errors)
        seqs = [seq for seq in seqs if seq not in errors]
        return seqs, runner.prepare_sampling(seqs, is_prefill) if seqs else None

    def _finish_inflight(self, done: list[Sequence], after_accept=None):
        """Reads the in-flight forward's sampled tokens and books them (``Scheduler.postprocess``);
        ``after_accept(refused)`` is called once the matchers have taken them, before the stop checks (``refused``:
        the sequences whose grammar refused its token)."""
        step, output = self.inflight
        self.inflight = None
        finished_before = [seq.is_finished for seq in step.seqs]  # on an earlier token: reported then
        # with NCCL ranks, poll the step's completion so that a dead worker is noticed (wait_for_event)
        workers = self.resources.workers
        alive = (lambda: not workers.dead()) if workers is not None and self.config.device == "cuda" else None
        token_ids, logprobs, prompt_logprobs = self.guarded(output.result, alive)
        advanced = self.scheduler.postprocess(step, token_ids, logprobs, prompt_logprobs)
        constrained = [(seq, token_id) for seq, token_id in advanced if seq.grammar is not None]
        refusals = {}  # the matchers follow the known tokens, all advanced in one call
        if constrained:
            errors = accept_tokens([seq.grammar for seq, _ in constrained], [t for _, t in constrained])
            refusals = {seq: e for (seq, _), e in zip(constrained, errors) if e is not None}
        if after_accept is not None:
            after_accept(refusals.keys())
        for seq, token_id in advanced:
            try:
                if seq in refusals:
                    raise refusals[seq]
                self._check_stop(seq, token_id)
            except Exception as e:  # the sequence's own text failed to decode, or its grammar refused the token
                self.fail(seq, e)
        for seq in step.seqs if step.is_prefill else ():  # completions 1..n-1 start once 0's prompt is cached
            request = self.requests.get(seq.seq_id)
            if request is not None and request.waiting_siblings and \
                    (seq.num_cached_tokens >= seq.num_prompt_tokens or seq.is_finished):
                for sibling in request.waiting_siblings:
                    self.scheduler.add(sibling)
                request.waiting_siblings = []
        done.extend(seq for seq, finished in zip(step.seqs, finished_before) if not finished)

    def _check_stop(self, seq: Sequence, token_id: int):
        """Whether ``token_id``, just appended, ends ``seq``, in vLLM's order: ``max_tokens`` or
        ``max_model_len`` ("length"); else a stop token (EOS unless ``ignore_eos``, or one of
        ``stop_token_ids``) once ``min_tokens`` are out; then a stop string that the new text completes,
        once more than ``min_tokens`` are out, ends it as "stop" whatever came before (the text is cut
        there). ``stop_reason``: the stop token id or string (None for the model's EOS), as vLLM's; a stop token's text
        is left out unless ``include_stop_str_in_output``. Then queues the text a stream may show (all but
        what could still begin a stop string)."""
        sp, detok = seq.sampling_params, seq.detokenizer
        num_out = len(seq.token_ids) - seq.num_prompt_tokens
        stops = sp.stop_strings
        reason = hit = None
        if num_out >= sp.max_tokens or len(seq.token_ids) >= self.scheduler.max_model_len:
            reason = "length"
        elif num_out >= sp.min_tokens and not sp.ignore_eos and token_id in self.eos_token_ids:
            reason = "stop"
            if token_id != self.eos_token_id:  # generation_config's other EOS ids are stop tokens to vLLM
                seq.stop_reason = token_id
        elif num_out >= sp.min_tokens and token_id in sp.stop_token_ids:
            reason, seq.stop_reason = "stop", token_id
        # a stop token's own text is not part of the output unless include_stop_str_in_output (vLLM's)
        counts = detok is not None and (reason != "stop" or sp.include_stop_str_in_output)
        delta = detok.add(token_id) if counts else ""
        if stops and reason != "stop" and num_out > sp.min_tokens and (hit := detok.find_stop(stops, delta)):
            at, stop = hit
            detok.text = detok.text[:at + len(stop) if sp.include_stop_str_in_output else at]
            reason, seq.stop_reason = "stop", stop
        if reason:
            self.scheduler.finish(seq, reason)
        if detok is not None:
            if reason and not hit:
                detok.flush()
            self._stream_piece(seq, detok.take(0 if reason or not stops else max(map(len, stops)) - 1), [token_id])

    def _stream_piece(self, seq: Sequence, text: str, token_ids: list[int]):
        """Queues a piece for the stream() call that owns ``seq``'s request, if one does."""
        request = self.requests.get(seq.seq_id)
        if request is not None and request.stream is not None:
            request.stream.append({"index": request.index, "output_index": request.seqs.index(seq), "text": text,
                                   "token_ids": token_ids, "finished": seq.is_finished,
                                   "finish_reason": seq.finish_reason})

    # ---- ending requests --------------------------------------------------------------------
    def fail(self, seq: Sequence, error: Exception):
        """A failure that is this sequence's own (its text, its sampling inputs) ends it alone."""
        request = self.requests[seq.seq_id]
        logger.warning("request %s, completion %d failed and was ended: %s: %s", request.request_id,
                       request.seqs.index(seq), type(error).__name__, error)
        request.error = f"{type(error).__name__}: {error}"
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        self._stream_piece(seq, "", [])

    def abort(self, request: Request):
        """Ends the request's unfinished completions (finish_reason "abort") and forgets it (under the lock)."""
        for seq in request.waiting_siblings:  # never scheduled: nothing to free
            seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, "abort", perf_counter()
        request.waiting_siblings = []
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self.forget(request)

    def forget(self, request: Request):
        for seq in request.seqs:
            self.requests.pop(seq.seq_id, None)

    def release(self, requests: list[Request]):
        """The end of a generate/stream call: its requests are forgotten, and those that did not finish
        (the call was left by an exception or a ``break``) are aborted."""
        with self.lock:
            for request in requests:
                if request.finished or self.resources.closed:
                    self.forget(request)
                else:
                    self.abort(request)
        self.drain_if_idle()
