"""The engine: tokenizer, requests, the step loop, outputs, and the tensor-parallel worker processes."""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import glob
import json
import multiprocessing.connection
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from time import perf_counter

import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.model_runner import ModelRunner, SampledTokens
from nanovllm.engine.scheduler import ScheduledStep, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _remove_stale_segments():
    """Shared-memory segments of engines whose process is gone (killed before it could unlink them)."""
    for path in glob.glob("/dev/shm/nanovllm-*"):
        pid = os.path.basename(path).split("-")[1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@dataclass
class Request:
    """One prompt and its ``n`` completions (sequences); completion 0 is prefilled first and the
    others wait for it, so that they find the prompt's blocks in the prefix cache."""

    index: int
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    waiting_siblings: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return not self.waiting_siblings and all(seq.is_finished for seq in self.seqs)


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        config = Config.from_kwargs(model, **kwargs)
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else \
            AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        config.eos_token_ids = _eos_token_ids(config, self.tokenizer)
        self.ps: list[mp.Process] = []
        self.events = []
        _remove_stale_segments()
        shm_name, port = f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:12]}", _free_port()
        ctx = mp.get_context("spawn")
        for rank in range(1, config.tensor_parallel_size):
            event = ctx.Event()
            process = ctx.Process(target=ModelRunner, args=(config, rank, event, shm_name, port), daemon=True)
            process.start()
            self.ps.append(process)
            self.events.append(event)
        try:
            self.model_runner = ModelRunner(config, 0, self.events, shm_name, port)
        except BaseException:
            for p in self.ps:  # the workers would wait for rank 0 forever
                p.kill()
            raise
        config.num_kvcache_blocks = self.model_runner.num_kvcache_blocks
        self.scheduler = Scheduler(config)
        self.requests: dict[int, Request] = {}   # the unfinished requests, by the seq_id of each sequence
        self._inflight: tuple[ScheduledStep, SampledTokens] | None = None  # launched, result not yet read
        self.async_scheduling = config.async_scheduling  # fixed for the engine's life (the runner relies on it)
        self._closed = False
        self._healthy = True   # False once a forward failed part-way: the ranks may disagree on where they are
        atexit.register(self.exit)
        if self.ps:
            threading.Thread(target=self._watch_workers, daemon=True).start()

    def exit(self):
        """Shuts the engine down and frees its processes and shared memory; safe to call twice, and
        after a failure (then without any collective: dead or stuck workers are killed)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.exit)
        runner = self.model_runner
        try:
            if self._healthy and self._workers_alive():
                runner.call("exit")
            else:
                runner.abandon()
        except Exception:
            runner.abandon()
        finally:
            for p in self.ps:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
            del self.model_runner

    def _workers_alive(self) -> bool:
        return not self._dead_workers()

    def _dead_workers(self) -> list[tuple[int, int | None]]:
        return [(rank, p.exitcode) for rank, p in enumerate(self.ps, 1) if not p.is_alive()]

    def _watch_workers(self):
        """When a worker dies, rank 0 may be waiting for it in a collective, which NCCL would do forever:
        abort the process group so that the collective raises (gloo raises by itself)."""
        multiprocessing.connection.wait([p.sentinel for p in self.ps])
        if not self._closed and self.config.device == "cuda":
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()

    def _guarded(self, fn, *args):
        """``fn(*args)`` (a forward on every rank, or reading one's result); a failure part-way (a dead
        worker, Ctrl-C) shuts the engine down, and a dead worker is named."""
        try:
            return fn(*args)
        except BaseException as e:
            self._healthy = False
            dead = self._dead_workers()
            self.exit()
            if dead:
                rank, code = dead[0]
                raise RuntimeError(f"tensor-parallel worker rank {rank} died (exit code {code}); the engine "
                                   "has been shut down") from e
            raise

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | dict, sampling_params: SamplingParams,
                    index: int = 0, stream: bool = False) -> Request:
        prompt_ids = self._prompt_token_ids(index, prompt)
        seqs = []
        for i in range(sampling_params.n):
            sp = sampling_params if sampling_params.seed is None or i == 0 else \
                dataclasses.replace(sampling_params, seed=sampling_params.seed + i)
            seq = Sequence(prompt_ids, sp, self.config.kvcache_block_size)
            if i == 0 and sp.prompt_logprobs is not None:  # one completion computes them for the request
                seq.computes_prompt_logprobs = True
                seq.prompt_logprobs = [None]  # the first prompt token has none
            if stream or sp.stop_strings:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, sp.skip_special_tokens)
            seqs.append(seq)
        request = Request(index, prompt_ids, seqs, waiting_siblings=seqs[1:])
        self.requests.update((seq.seq_id, request) for seq in seqs)
        self.scheduler.add(seqs[0])
        return request

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """One forward. Returns the sequences that finished, as (seq_id, completion token ids),
        and the number of tokens processed (positive: prefill tokens; negative: decoded sequences)."""
        seqs, num_tokens, _ = self._step()
        finished = [seq for seq in seqs if seq.is_finished]
        for seq in finished:
            self._pop_if_finished(seq)
        return [(seq.seq_id, seq.completion_token_ids) for seq in finished], num_tokens

    def _step(self) -> tuple[list[Sequence], int, list[tuple[Sequence, int, str]]]:
        """Schedules and launches one forward, and reads back the results of the one before it
        (async scheduling) or of this one. Returns the sequences whose results were read, the tokens
        launched (positive: prefill tokens; negative: decoded sequences), and (sequence, token, new
        text) for each sequence with a detokenizer that gained a token."""
        if self._closed:
            raise RuntimeError("the engine has been shut down (exit() or a failure); create a new LLM")
        seqs, is_prefill = self.scheduler.schedule()
        done: list[Sequence] = []
        deltas: list[tuple[Sequence, int, str]] = []
        # penalties read every generated token, so such a decode batch waits for the step in flight (which
        # may finish some of its sequences); a prefill never has a token in flight
        if seqs and not is_prefill and self._inflight is not None and self._needs_history(seqs):
            self._finish_inflight(done, deltas)
            seqs = [seq for seq in seqs if not seq.is_finished]
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        launched = None
        if seqs:
            prev_rows = None
            if not is_prefill and any(seq.num_pending_tokens for seq in seqs):
                prev_rows = [seq.inflight_row if seq.num_pending_tokens else -1 for seq in seqs]
            output = self._guarded(self.model_runner.call, "run", seqs, is_prefill, prev_rows)
            launched = self.scheduler.launched(seqs, is_prefill), output
        elif self._inflight is None and not done:
            raise RuntimeError("the scheduler found nothing to run and no forward is in flight")
        if self._inflight is not None:
            self._finish_inflight(done, deltas)
        self._inflight = launched
        if not self.async_scheduling and launched is not None:
            self._finish_inflight(done, deltas)
        return done, num_tokens, deltas

    @staticmethod
    def _needs_history(seqs: list[Sequence]) -> bool:
        return any(seq.sampling_params.needs_penalties for seq in seqs)

    def _finish_inflight(self, done: list[Sequence], deltas: list[tuple[Sequence, int, str]]):
        """Reads the in-flight forward's sampled tokens and books them (``Scheduler.postprocess``)."""
        step, output = self._inflight
        self._inflight = None
        finished_before = [seq.is_finished for seq in step.seqs]  # on an earlier token: reported then
        # with NCCL ranks, poll the step's completion so that a dead worker is noticed (wait_for_event)
        alive = self._workers_alive if self.ps and self.config.device == "cuda" else None
        token_ids, logprobs, prompt_logprobs = self._guarded(output.result, alive)
        for seq, token_id in self.scheduler.postprocess(step, token_ids, logprobs, prompt_logprobs):
            if seq.detokenizer is not None:
                deltas.append((seq, token_id, self._new_text(seq, token_id)))
        for seq in step.seqs if step.is_prefill else ():  # completions 1..n-1 start once 0's prompt is cached
            request = self.requests[seq.seq_id]
            if request.waiting_siblings and (seq.num_cached_tokens >= seq.num_prompt_tokens or seq.is_finished):
                for sibling in request.waiting_siblings:
                    self.scheduler.add(sibling)
                request.waiting_siblings = []
        done.extend(seq for seq, finished in zip(step.seqs, finished_before) if not finished)

    def _interruptible_step(self):
        """``_step``; Ctrl-C shuts the engine down (processes, shared memory) before it propagates."""
        try:
            return self._step()
        except KeyboardInterrupt:
            self.exit()
            raise

    def _new_text(self, seq: Sequence, token_id: int) -> str:
        """Feeds the new token to the sequence's detokenizer; finishes it on a stop string."""
        delta = seq.detokenizer.add(token_id)
        stops = seq.sampling_params.stop_strings
        hit = seq.detokenizer.find_stop(stops, delta) if stops and not seq.is_finished else None
        if hit:
            at, stop = hit
            end = at + len(stop) if seq.sampling_params.include_stop_str_in_output else at
            delta = delta[:max(0, len(delta) - (len(seq.detokenizer.text) - end))]
            seq.detokenizer.text = seq.detokenizer.text[:end]
            self.scheduler.finish(seq, "stop")
        elif seq.is_finished:
            delta += seq.detokenizer.flush()
        return delta

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._inflight is None

    # ---- the offline API -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Completions of ``prompts`` (strings, token-id lists, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": ...} dicts), in prompt order. See ``_output`` for the fields."""
        requests = self._add_requests(prompts, sampling_params)
        pbar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        while not self.is_finished():
            t = perf_counter()
            seqs, num_tokens, _ = self._interruptible_step()
            if num_tokens > 0:
                prefill_tps = num_tokens / (perf_counter() - t)
            else:
                decode_tps = -num_tokens / (perf_counter() - t)
            pbar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s", refresh=False)
            pbar.update(sum(self._pop_if_finished(seq) for seq in seqs))
        pbar.close()
        return [self._output(r) for r in requests]

    def stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[dict]:
        """Yields new text as it is produced: dicts with ``index`` (the prompt's), ``output_index``
        (which of its n completions), ``text`` (the new text; a token that ends inside a UTF-8
        character waits for the next), ``token_ids`` (the new token), and ``finished`` /
        ``finish_reason`` on a completion's last piece."""
        requests = self._add_requests(prompts, sampling_params, stream=True)
        seq_index = {seq.seq_id: (r.index, i) for r in requests for i, seq in enumerate(r.seqs)}
        while not self.is_finished():
            seqs, _, deltas = self._interruptible_step()
            for seq, token_id, delta in deltas:
                index, output_index = seq_index[seq.seq_id]
                yield {"index": index, "output_index": output_index, "text": delta, "token_ids": [token_id],
                       "finished": seq.is_finished, "finish_reason": seq.finish_reason}
            for seq in seqs:
                self._pop_if_finished(seq)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             **template_kwargs) -> list[dict]:
        """``generate`` on one conversation (a list of {"role", "content"} messages) or a list of
        them, each rendered by the tokenizer's chat template with the generation prompt added."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("chat needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self._token_list(self.tokenizer.apply_chat_template(
            conv, tokenize=True, add_generation_prompt=True, **template_kwargs))} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _token_list(encoded) -> list[int]:
        """apply_chat_template(tokenize=True) returns a list, or a BatchEncoding in newer transformers."""
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def _add_requests(self, prompts, sampling_params, stream: bool = False) -> list[Request]:
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
        vocab_size = self.config.hf_config.vocab_size
        for sp in sampling_params:  # a top k beyond the vocabulary would fail inside the forward
            for name in ("logprobs", "prompt_logprobs"):
                if (getattr(sp, name) or 0) > vocab_size:
                    raise ValueError(f"{name} must be <= the vocabulary size {vocab_size}, got {getattr(sp, name)}")
        if stream or any(sp.stop_strings for sp in sampling_params):
            self._require_tokenizer("stop strings and streaming")  # fail before any work
        checked = [self._prompt_token_ids(i, p) for i, p in enumerate(prompts)]  # all, before adding any
        return [self.add_request(ids, sp, i, stream) for i, (ids, sp) in enumerate(zip(checked, sampling_params))]

    def _prompt_token_ids(self, i: int, prompt) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids': {sorted(prompt)}")
        if isinstance(prompt, str):
            prompt = self._encode(prompt)
        elif not isinstance(prompt, (list, tuple)) or not all(type(t) is int for t in prompt):
            raise TypeError(f"prompt {i} must be a string, a list of ints or a dict, got {prompt!r:.80}")
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        vocab_size = self.config.hf_config.vocab_size
        if bad := [t for t in prompt if not 0 <= t < vocab_size]:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        self._check_fits(i, len(prompt))
        return list(prompt)

    def _check_fits(self, i: int, num_tokens: int):
        config = self.config
        if num_tokens >= config.max_model_len:
            raise ValueError(f"prompt {i} has {num_tokens} tokens; max_model_len={config.max_model_len} "
                             "leaves no room for output")
        capacity = config.num_kvcache_blocks * config.kvcache_block_size
        if num_tokens + 1 > capacity:
            raise ValueError(f"prompt {i} has {num_tokens} tokens but the whole KV cache holds {capacity} "
                             f"({config.num_kvcache_blocks} blocks of {config.kvcache_block_size})")

    def _pop_if_finished(self, seq: Sequence) -> bool:
        """Forgets the request of ``seq`` once all its completions are done; True if it did."""
        request = self.requests.get(seq.seq_id)
        if request is None or not request.finished:
            return False
        for s in request.seqs:
            del self.requests[s.seq_id]
        return True

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
        metrics = {"time_to_first_token": min(s.first_token_time for s in request.seqs) - first.arrival_time,
                   "total_time": max(s.finish_time for s in request.seqs) - first.arrival_time}
        out = {**completions[0], "prompt_token_ids": request.prompt_token_ids,
               "num_cached_tokens": first.num_prefix_cached_tokens or 0, "metrics": metrics, "outputs": completions}
        if first.prompt_logprobs is not None:
            out["prompt_logprobs"] = first.prompt_logprobs
        return out
