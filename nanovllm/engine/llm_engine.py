"""The engine: tokenizer, requests, the step loop and outputs; tensor-parallel workers through
``WorkerGroup``.

Every public call (``generate``, ``stream``, ``chat``, ``step``) takes the engine's lock for each step,
so calls from several threads, or a ``generate`` inside a ``stream`` loop, take turns: each call waits
for its own requests only, and a stream's pieces wait in its own queue while other calls step the engine.
A stream that is left early (``break``, an exception in its loop) aborts its unfinished requests.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.model_runner import ModelRunner, SampledTokens
from nanovllm.engine.scheduler import ScheduledStep, Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.worker_group import WorkerDiedError, WorkerGroup
from nanovllm.sampling_params import MAX_SEED, SamplingParams
from nanovllm.utils.loader import load_tokenizer

logger = logging.getLogger("nanovllm")
# a peer's sockets close (and a collective fails) a moment before its exit status can be read
DEATH_GRACE_S = 3.0


def _eos_token_ids(config: Config, tokenizer) -> tuple[int, ...]:
    """Every EOS id of the checkpoint: generation_config.json's (else config.json's; one or a list)
    and the tokenizer's."""
    ids: set[int] = set()
    path = os.path.join(config.model, "generation_config.json")
    eos = getattr(config.hf_config, "eos_token_id", None)
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


@dataclass
class Request:
    """One prompt and its ``n`` completions (sequences); completion 0 is prefilled first and the
    others wait for it, so that they find the prompt's blocks in the prefix cache."""

    index: int
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    waiting_siblings: list[Sequence] = field(default_factory=list)
    stream: deque | None = None      # the pieces its stream() call has not yielded yet
    error: str | None = None         # why a completion ended with finish_reason "error"

    @property
    def finished(self) -> bool:
        return not self.waiting_siblings and all(seq.is_finished for seq in self.seqs)


class _Resources:
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


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        config = Config.from_kwargs(model, **kwargs)
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        config.eos_token_ids = _eos_token_ids(config, self.tokenizer)
        self._resources = resources = _Resources()
        self._finalizer = weakref.finalize(self, resources.close)
        try:
            group = None
            if config.tensor_parallel_size > 1:
                resources.workers = WorkerGroup(config)
                group = resources.workers.connect()
            resources.runner = ModelRunner(config, 0, group)
        except BaseException as e:
            resources.healthy = False
            error = self._named(e)
            self._finalizer()
            if error is e:
                raise
            raise error from e
        config.num_kvcache_blocks = resources.runner.num_kvcache_blocks
        self.scheduler = Scheduler(config)
        self.requests: dict[int, Request] = {}   # the unfinished requests, by the seq_id of each sequence
        self._inflight: tuple[ScheduledStep, SampledTokens] | None = None  # launched, result not yet read
        self.async_scheduling = config.async_scheduling  # fixed for the engine's life (the runner relies on it)
        self._lock = threading.Lock()  # one step (or request admission) at a time

    # ---- life cycle ------------------------------------------------------------------------
    @property
    def model_runner(self) -> ModelRunner | None:
        """Rank 0's runner (None once the engine is shut down)."""
        return self._resources.runner

    @property
    def workers(self) -> WorkerGroup | None:
        return self._resources.workers

    def exit(self):
        """Shuts the engine down and frees its processes, shared memory and device memory; safe to call
        twice, and after a failure (then dead or stuck workers are killed, not waited for). Also runs
        when the engine is garbage-collected, and at interpreter exit."""
        self._finalizer()

    shutdown = exit

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()

    def _named(self, e: BaseException) -> BaseException:
        """The error to raise for ``e``: a ``WorkerDiedError`` naming the rank when a worker died (or dies
        within a moment: its sockets close before its exit status is known), else ``e`` itself."""
        workers = self._resources.workers
        if workers is None or isinstance(e, (WorkerDiedError, KeyboardInterrupt, ValueError, TypeError)):
            return e
        dead = workers.wait_for_death(DEATH_GRACE_S)
        if not dead:
            return e
        rank, code = dead[0]
        return WorkerDiedError(f"tensor-parallel worker rank {rank} died (exit code {code}); the engine has been "
                               "shut down")

    def _guarded(self, fn, *args):
        """``fn(*args)`` (a forward on every rank, or reading one's result); a failure part-way (a dead
        worker, Ctrl-C) shuts the engine down, and a dead worker is named."""
        try:
            return fn(*args)
        except BaseException as e:
            self._resources.healthy = False
            error = self._named(e)
            self.exit()
            if error is e:
                raise
            raise error from e

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | dict, sampling_params: SamplingParams,
                    index: int = 0, stream: deque | None = None) -> Request:
        """Admits one prompt: its sampling parameters are checked and copied now (later assignments to
        the caller's object do not reach it). ``stream``: the queue its pieces go to."""
        prompt_ids = self._prompt_token_ids(index, prompt)
        sampling_params = self._admitted(sampling_params)
        seqs = []
        for i in range(sampling_params.n):
            sp = sampling_params if sampling_params.seed is None or i == 0 else \
                dataclasses.replace(sampling_params, seed=(sampling_params.seed + i) % MAX_SEED)
            seq = Sequence(prompt_ids, sp, self.config.kvcache_block_size)
            if i == 0 and sp.prompt_logprobs is not None:  # one completion computes them for the request
                seq.computes_prompt_logprobs = True
                seq.prompt_logprobs = [None]  # the first prompt token has none
            if stream is not None or sp.stop_strings:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, sp.skip_special_tokens)
            seqs.append(seq)
        request = Request(index, prompt_ids, seqs, waiting_siblings=seqs[1:], stream=stream)
        with self._lock:
            self.requests.update((seq.seq_id, request) for seq in seqs)
            self.scheduler.add(seqs[0])
        return request

    def _admitted(self, sampling_params: SamplingParams) -> SamplingParams:
        """A checked copy of ``sampling_params``, with what depends on this engine checked too."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        sp = sampling_params.clone()
        sp.verify()
        vocab_size = self.config.hf_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):  # a top k beyond the vocabulary would fail inside the forward
            if (getattr(sp, name) or 0) > vocab_size:
                raise ValueError(f"{name} must be <= the vocabulary size {vocab_size}, got {getattr(sp, name)}")
        if bad := [t for t in sp.stop_token_ids if t >= vocab_size]:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        if sp.stop_strings:
            self._require_tokenizer("stop strings")
        return sp

    def abort_request(self, request: Request):
        """Ends the request's unfinished completions (finish_reason "abort") and forgets it."""
        with self._lock:
            self._abort(request)

    def _abort(self, request: Request):
        for seq in request.waiting_siblings:  # never scheduled: nothing to free
            seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, "abort", perf_counter()
        request.waiting_siblings = []
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self._forget(request)

    def _forget(self, request: Request):
        for seq in request.seqs:
            self.requests.pop(seq.seq_id, None)

    def _fail(self, seq: Sequence, error: Exception):
        """A failure that is this sequence's own (its text, its sampling inputs) ends it alone."""
        request = self.requests[seq.seq_id]
        logger.warning("request %d, completion %d failed and was ended: %s: %s", request.index,
                       request.seqs.index(seq), type(error).__name__, error)
        request.error = f"{type(error).__name__}: {error}"
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        if request.stream is not None:
            request.stream.append({"index": request.index, "output_index": request.seqs.index(seq), "text": "",
                                   "token_ids": [], "finished": True, "finish_reason": seq.finish_reason})

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """One forward. Returns the sequences that finished, as (seq_id, completion token ids),
        and the number of tokens processed (positive: prefill tokens; negative: decoded sequences)."""
        with self._lock:
            seqs, num_tokens = self._step()
            finished = [seq for seq in seqs if seq.is_finished]
            for seq in finished:
                request = self.requests.get(seq.seq_id)
                if request is not None and request.finished:
                    self._forget(request)
        return [(seq.seq_id, seq.completion_token_ids) for seq in finished], num_tokens

    def _step(self) -> tuple[list[Sequence], int]:
        """Schedules and launches one forward, and reads back the results of the one before it
        (async scheduling) or of this one. Returns the sequences whose results were read (or that
        ended) and the tokens launched (positive: prefill tokens; negative: decoded sequences)."""
        if self._resources.closed:
            raise RuntimeError("the engine has been shut down (exit() or a failure); create a new LLM")
        seqs, is_prefill = self.scheduler.schedule()
        done: list[Sequence] = []
        # penalties read every generated token, so such a decode batch waits for the step in flight (which
        # may finish some of its sequences); a prefill never has a token in flight
        if seqs and not is_prefill and self._inflight is not None and self._needs_history(seqs):
            self._finish_inflight(done)
            seqs = [seq for seq in seqs if not seq.is_finished]
        sampling = None
        if seqs:
            seqs, sampling = self._prepare_sample(seqs, done)
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        launched = None
        if seqs:
            prev_rows = None
            if not is_prefill and any(seq.num_pending_tokens for seq in seqs):
                prev_rows = [seq.inflight_row if seq.num_pending_tokens else -1 for seq in seqs]
            output = self._guarded(self._launch, seqs, is_prefill, prev_rows, sampling)
            launched = self.scheduler.launched(seqs, is_prefill), output
        elif self._inflight is None and not done:
            raise RuntimeError("the scheduler found nothing to run and no forward is in flight")
        if self._inflight is not None:
            self._finish_inflight(done)
        self._inflight = launched
        if not self.async_scheduling and launched is not None:
            self._finish_inflight(done)
        return done, num_tokens

    def _launch(self, seqs: list[Sequence], is_prefill: bool, prev_rows: list[int] | None, sampling):
        if self._resources.workers is not None:
            self._resources.workers.call("run", seqs, is_prefill, prev_rows)
        return self.model_runner.run(seqs, is_prefill, prev_rows, sampling)

    def _prepare_sample(self, seqs: list[Sequence], done: list[Sequence]):
        """Rank 0's sampling inputs, built before any rank starts the step: a sequence whose own
        parameters make this fail is ended alone (``_fail``) and the step goes on without it."""
        runner = self.model_runner
        try:
            return seqs, runner.prepare_sample(seqs)
        except Exception:
            errors = {}
            for seq in seqs:
                try:
                    runner.prepare_sample([seq])
                except Exception as e:
                    errors[seq.seq_id] = e
            if not errors:
                raise
        for seq in seqs:
            if seq.seq_id in errors:
                self._fail(seq, errors[seq.seq_id])
                done.append(seq)
        seqs = [seq for seq in seqs if seq.seq_id not in errors]
        return seqs, runner.prepare_sample(seqs) if seqs else None

    @staticmethod
    def _needs_history(seqs: list[Sequence]) -> bool:
        return any(seq.sampling_params.needs_penalties for seq in seqs)

    def _finish_inflight(self, done: list[Sequence]):
        """Reads the in-flight forward's sampled tokens and books them (``Scheduler.postprocess``)."""
        step, output = self._inflight
        self._inflight = None
        finished_before = [seq.is_finished for seq in step.seqs]  # on an earlier token: reported then
        # with NCCL ranks, poll the step's completion so that a dead worker is noticed (wait_for_event)
        workers = self._resources.workers
        alive = (lambda: not workers.dead()) if workers is not None and self.config.device == "cuda" else None
        token_ids, logprobs, prompt_logprobs = self._guarded(output.result, alive)
        for seq, token_id in self.scheduler.postprocess(step, token_ids, logprobs, prompt_logprobs):
            if seq.detokenizer is not None:
                try:
                    self._new_text(seq, token_id)
                except Exception as e:
                    self._fail(seq, e)
        for seq in step.seqs if step.is_prefill else ():  # completions 1..n-1 start once 0's prompt is cached
            request = self.requests.get(seq.seq_id)
            if request is not None and request.waiting_siblings and \
                    (seq.num_cached_tokens >= seq.num_prompt_tokens or seq.is_finished):
                for sibling in request.waiting_siblings:
                    self.scheduler.add(sibling)
                request.waiting_siblings = []
        done.extend(seq for seq, finished in zip(step.seqs, finished_before) if not finished)

    def _interruptible_step(self) -> tuple[list[Sequence], int]:
        """``_step`` under the lock; Ctrl-C shuts the engine down (processes, shared memory) before it
        propagates."""
        with self._lock:
            if self.is_finished():  # another thread's step finished what the caller was waiting for
                return [], 0
            try:
                return self._step()
            except KeyboardInterrupt:
                self.exit()
                raise

    def _new_text(self, seq: Sequence, token_id: int):
        """Feeds the new token to the sequence's detokenizer; finishes it on a stop string; queues the
        text a stream may show (all but what could still turn out to begin a stop string)."""
        detok = seq.detokenizer
        delta = detok.add(token_id)
        stops = seq.sampling_params.stop_strings
        hit = detok.find_stop(stops, delta) if stops and not seq.is_finished else None
        if hit:
            at, stop = hit
            detok.text = detok.text[:at + len(stop) if seq.sampling_params.include_stop_str_in_output else at]
            self.scheduler.finish(seq, "stop")
        elif seq.is_finished:
            detok.flush()
        request = self.requests.get(seq.seq_id)
        if request is not None and request.stream is not None:
            holdback = 0 if seq.is_finished or not stops else max(map(len, stops)) - 1
            request.stream.append({"index": request.index, "output_index": request.seqs.index(seq),
                                   "text": detok.take(holdback), "token_ids": [token_id],
                                   "finished": seq.is_finished, "finish_reason": seq.finish_reason})

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._inflight is None

    # ---- the offline API -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Completions of ``prompts`` (strings, token-id lists, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": ...} dicts), in prompt order. See ``_output`` for the fields."""
        requests = self._add_requests(prompts, sampling_params)
        pbar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            pending, speed = requests, {"prefill": 0.0, "decode": 0.0}
            while pending:
                t = perf_counter()
                num_tokens = self._interruptible_step()[1]
                speed["prefill" if num_tokens > 0 else "decode"] = abs(num_tokens) / (perf_counter() - t)
                pbar.set_postfix({k: f"{v:.0f}tok/s" for k, v in speed.items()}, refresh=False)
                pending, before = [r for r in pending if not r.finished], len(pending)
                pbar.update(before - len(pending))
        finally:
            pbar.close()
            self._abort_unfinished(requests)
        return [self._output(r) for r in requests]

    def _drain_if_idle(self):
        """Reads back a step still in flight once nothing else is left to do, so that an idle engine holds
        no forward (async scheduling leaves one behind the last token)."""
        with self._lock:
            if self._inflight is not None and self.scheduler.is_finished() and not self._resources.closed:
                self._step()

    def _abort_unfinished(self, requests: list[Request]):
        """The end of a generate/stream call: its requests are forgotten, and those that did not finish
        (the call was left by an exception or a ``break``) are aborted."""
        with self._lock:
            for request in requests:
                if request.finished or self._resources.closed:
                    self._forget(request)
                else:
                    self._abort(request)
        self._drain_if_idle()

    def stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[dict]:
        """Yields new text as it is produced: dicts with ``index`` (the prompt's), ``output_index``
        (which of its n completions), ``text`` (the new text; a token that ends inside a UTF-8
        character, or text that may begin a stop string, waits for the next), ``token_ids`` (the new
        token), and ``finished`` / ``finish_reason`` on a completion's last piece. Leaving the loop early
        aborts the requests that have not finished."""
        queue: deque = deque()
        requests = self._add_requests(prompts, sampling_params, stream=queue)
        try:
            while True:
                while queue:
                    yield queue.popleft()
                if all(r.finished for r in requests):
                    break
                self._interruptible_step()
        finally:
            self._abort_unfinished(requests)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True, *,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list | None = None,
             chat_template_content_format: str = "auto", lora_request=None, mm_processor_kwargs=None) -> list[dict]:
        """``generate`` on one conversation (a list of {"role", "content"} messages) or a list of them,
        each rendered by the tokenizer's chat template (or ``chat_template``), with vLLM's keywords and
        meanings: ``chat_template_kwargs`` become template variables (e.g. ``{"enable_thinking": False}``),
        ``add_generation_prompt`` opens the assistant's turn, ``continue_final_message`` leaves the last
        message open for the model to continue, ``tools`` are passed to the template."""
        for name, value in (("lora_request", lora_request), ("mm_processor_kwargs", mm_processor_kwargs)):
            if value is not None:
                raise ValueError(f"{name} is not supported by nanovllm (no LoRA, no multimodal models)")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError("chat_template_content_format must be 'auto' or 'string' (message contents are "
                             f"strings), got {chat_template_content_format!r}")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True: pass "
                             "add_generation_prompt=False to continue the final message")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r}")
        if self.tokenizer is None or not (chat_template or self.tokenizer.chat_template):
            raise ValueError("chat needs a tokenizer with a chat template (or chat_template=...)")
        conversations = messages
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            conversations = [messages]  # one conversation
        if not isinstance(conversations, list) or not all(
                isinstance(c, list) and all(isinstance(m, dict) for m in c) for c in conversations):
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of "
                            f"them, got {messages!r:.80}")
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, chat_template=chat_template, tools=tools,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}))
            # the template writes the special tokens (BOS and the like) itself
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- helpers ---------------------------------------------------------------------------
    def _add_requests(self, prompts, sampling_params, stream: deque | None = None) -> list[Request]:
        """Checks every prompt and every sampling parameter before admitting any."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                                isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of strings, token-id lists or dicts, got {type(prompts).__name__}")
        sampling_params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or \
                not all(isinstance(sp, SamplingParams) for sp in sampling_params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, one per prompt")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        if stream is not None:
            self._require_tokenizer("streaming")
        for sp in sampling_params:
            self._admitted(sp)
        checked = [self._prompt_token_ids(i, p) for i, p in enumerate(prompts)]
        return [self.add_request(ids, sp, i, stream) for i, (ids, sp) in enumerate(zip(checked, sampling_params))]

    def _prompt_token_ids(self, i: int, prompt) -> list[int]:
        if isinstance(prompt, dict):
            if unknown := sorted(set(prompt) - {"prompt", "prompt_token_ids"}):
                raise ValueError(f"prompt {i} has keys {unknown} that nanovllm does not support (it reads "
                                 "'prompt' or 'prompt_token_ids')")
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, (list, tuple)):  # a string here is not to be tokenized
                    raise TypeError(f"prompt {i}'s prompt_token_ids must be a list of ints, got {prompt!r:.80}")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError(f"prompt {i}'s 'prompt' must be a string, got {prompt!r:.80}")
            else:
                raise ValueError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            prompt = self._encode(prompt)
        elif not isinstance(prompt, (list, tuple)) or not all(type(t) is int for t in prompt):
            raise TypeError(f"prompt {i} must be a string, a list of ints or a dict, got {prompt!r:.80}")
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        vocab_size = self.config.hf_config.vocab_size
        if bad := [t for t in prompt if not 0 <= t < vocab_size]:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        config = self.config
        if len(prompt) >= config.max_model_len:
            capacity = config.num_kvcache_blocks * config.kvcache_block_size
            cache = f" (the whole KV cache holds {capacity} tokens)" if capacity == config.max_model_len else ""
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; max_model_len={config.max_model_len}{cache} "
                             "leaves no room for output")
        return list(prompt)

    def _require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{what} need a tokenizer, but the engine has skip_tokenizer_init=True")

    def _encode(self, prompt: str) -> list[int]:
        self._require_tokenizer("string prompts (pass token ids instead)")
        return self.tokenizer.encode(prompt)

    def _completion(self, seq: Sequence) -> dict:
        sp = seq.sampling_params
        if self.tokenizer is None:
            text = ""
        elif seq.detokenizer is not None and seq.finish_reason == "stop" and sp.stop_strings:
            text = seq.detokenizer.text  # cut at the stop string
        else:
            text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=sp.skip_special_tokens)
        out = {"text": text, "token_ids": seq.completion_token_ids, "finish_reason": seq.finish_reason}
        if sp.logprobs is not None:
            out["logprobs"] = seq.logprobs
        return out

    def _output(self, request: Request) -> dict:
        """The nano-vllm fields (``text``, ``token_ids``: completion 0) and vLLM's: ``finish_reason``,
        ``prompt_token_ids``, ``num_cached_tokens``, ``logprobs`` and ``prompt_logprobs`` (when
        asked), ``metrics`` and ``outputs`` (all n completions)."""
        completions = [self._completion(seq) for seq in request.seqs]
        first = request.seqs[0]
        first_tokens = [s.first_token_time for s in request.seqs if s.first_token_time is not None]
        metrics = {"time_to_first_token": min(first_tokens) - first.arrival_time if first_tokens else None,
                   "total_time": max(s.finish_time or 0.0 for s in request.seqs) - first.arrival_time}
        out = {**completions[0], "prompt_token_ids": request.prompt_token_ids,
               "num_cached_tokens": first.num_prefix_cached_tokens or 0, "metrics": metrics, "outputs": completions}
        if first.prompt_logprobs is not None:
            out["prompt_logprobs"] = first.prompt_logprobs
        if request.error is not None:
            out["error"] = request.error
        return out
