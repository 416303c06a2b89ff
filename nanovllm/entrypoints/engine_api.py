"""vLLM's engine methods beside nano-vllm's (``VllmEngineMixin``, which the frontend's
``LLMEngine`` inherits): ``add_request`` by request id and ``step``'s ``RequestOutput``s, ``chat``,
``collective_rpc``, the profiler, metrics, the RL surface (``update_weights``,
``sleep``/``wake_up``), ``get_default_sampling_params`` and the model's config."""
from __future__ import annotations

import functools
import json
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from nanovllm.config import CHOICES
from nanovllm.engine.detokenizer import stop_holdback
from nanovllm.engine.llm_engine import encode
from nanovllm.engine.outputs import Request, request_output
from nanovllm.engine.worker_group import call_every_rank
from nanovllm.entrypoints.arg_utils import _PROFILER_FLAGS, EngineArgs, refuse_unsupported
from nanovllm.models.presets import load_dummy_weights
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.plugins import REGISTRY
from nanovllm.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    check_bool,
    check_number,
)
from nanovllm.utils.loader import load_model

if TYPE_CHECKING:
    from nanovllm.entrypoints.llm import LLMEngine

# generation_config.json's field -> SamplingParams'
_GENERATION_FIELDS = {name: name for name in ("temperature", "top_p", "top_k", "min_p",
                                              "repetition_penalty")}
_GENERATION_FIELDS["max_new_tokens"] = "max_tokens"




@dataclass(frozen=True)
class ModelConfig:
    """The fields of vLLM's ``llm_engine.model_config`` that scripts read."""

    model: str
    tokenizer: str | None
    dtype: object
    max_model_len: int
    hf_config: object


class VllmEngineMixin:
    """vLLM's engine methods, on the core ``LLMEngine``'s ``core``, ``config``, ``tokenizer`` and
    ``_step_requests``."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs):
        return cls(engine_args.model, **engine_args.kwargs)

    def add_request(self, *args, **kwargs):
        """nano-vllm's ``add_request(prompt, sampling_params)``, returning the ``Request``, or
        vLLM's ``add_request(request_id, prompt, params)``; either way ``step()`` reports it."""
        self._resources.check_open()
        if len(args) >= 2 and isinstance(args[1], SamplingParams) or "sampling_params" in kwargs:
            return self._add_prompt(*args, **kwargs)
        return self._add_request_by_id(*args, **kwargs)

    def _add_prompt(self, prompt, sampling_params: SamplingParams, index: int = 0,
                    stream: deque | None = None) -> Request:
        """nano-vllm's: admits one prompt, returning its ``Request``; ``step()`` reports it."""
        ids, text = self._parse_prompt(index, prompt)
        params = self._admitted(sampling_params)
        request = self._add(ids, text, params, index, stream, incremental=True)
        self._step_requests[request.request_id] = request
        return request

    def abort_request(self, request: Request | str | Iterable[str]):
        """Ends a ``Request``'s or request ids' unfinished completions (finish_reason "abort");
        ``step()`` does not report them."""
        self._resources.check_open()
        targets = [request] if isinstance(request, (str, Request)) else list(request)
        with self.core.lock:
            for target in targets:
                if isinstance(target, str):
                    target = self._step_requests.get(target)
                if target is not None:
                    self._step_requests.pop(target.request_id, None)
                    self.core.abort(target)

    def step(self) -> list[RequestOutput]:
        """One forward, if anything is left to run; a ``RequestOutput`` (by its ``output_kind``) for
        each ``add_request`` request with news since its last report, whoever ran the steps (a
        finished one once)."""
        self._resources.check_open()
        with self.core.lock:
            if not self.core.is_finished():
                self.core.step()
            outputs = []
            for request_id, request in list(self._step_requests.items()):
                if request is None:  # being admitted by another thread
                    continue
                if (output := step_output(request, self.tokenizer)) is None:
                    continue
                outputs.append(output)
                if request.finished:
                    self.core.forget(request)
                    del self._step_requests[request_id]
        return outputs

    def stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[dict]:
        """Yields dicts of new text: ``index`` (the prompt's), ``output_index``, ``text`` (held back
        while it may end inside a UTF-8 character or begin a stop string), ``token_ids``, and
        ``finished`` / ``finish_reason`` on a completion's last piece. Leaving the loop early aborts
        the unfinished requests."""
        self._resources.check_open()
        queue: deque = deque()
        requests = self._add_requests(prompts, sampling_params, stream=queue)
        try:
            while True:
                while queue:
                    yield queue.popleft()
                if all(r.finished for r in requests):
                    break
                self.core.interruptible_step()
        finally:
            self.core.release(requests)

    def beam_search(self, prompts, params, use_tqdm: bool = False, *, lora_request=None,
                    concurrency_limit: int | None = None) -> list:
        """For each prompt, its ``params.beam_width`` best sequences, best first (vLLM's
        ``BeamSearchOutput``s; ``features.beam_search``)."""
        self._resources.check_open()
        refuse_unsupported(lora_request=lora_request)
        return REGISTRY.get("method", "beam_search")(self, prompts, params, use_tqdm=use_tqdm,
                                                    concurrency_limit=concurrency_limit)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished, or an ``add_request`` one not yet reported finished by
        ``step()``."""
        self._resources.check_open()
        return not self.core.is_finished() or bool(self._step_requests)

    def get_num_unfinished_requests(self) -> int:
        self._resources.check_open()
        with self.core.lock:
            return len({id(r) for r in self.core.requests.values() if not r.finished})

    @property
    def llm_engine(self) -> LLMEngine:
        return self

    @property
    def model_config(self) -> ModelConfig:
        c = self.config
        return ModelConfig(c.model, c.tokenizer or c.model, c.torch_dtype, c.max_model_len,
                           c.hf_config)

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("get_tokenizer(): the engine has no tokenizer "
                             "(skip_tokenizer_init=True)")
        return self.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        return self.get_default_sampling_params()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults (``max_tokens=16``, not nano-vllm's 64) under the fields that the
        ``generation_config`` keyword's generation_config.json sets; what vLLM's forms use without
        params."""
        choice, fields = self.frontend["generation_config"], {}
        path = os.path.join(self.config.model if choice == "auto" else choice,
                            "generation_config.json")
        if choice != "vllm" and os.path.isfile(path):
            with open(path) as f:
                fields = json.load(f)
        return SamplingParams(**{"max_tokens": 16, **{
            ours: fields[theirs] for theirs, ours in _GENERATION_FIELDS.items()
            if fields.get(theirs) is not None}})

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached prefix block; refused (False) while requests hold blocks, unless
        ``reset_running_requests``: they are preempted first, to be recomputed from their known
        tokens."""
        self._resources.check_open()
        check_bool("reset_running_requests", reset_running_requests)
        with self.core.lock:
            scheduler = self.core.scheduler
            if reset_running_requests:
                self.core.read_back()  # the step in flight: its tokens become known
                while scheduler.running:
                    scheduler.preempt(scheduler.running.pop())
                for seq in scheduler.waiting:  # a prompt part-way through its chunks holds blocks
                    scheduler.block_manager.deallocate(seq)
            return scheduler.block_manager.reset_prefix_cache()

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: ``method`` (a method's name, of the worker: the runner with
        ``worker_extension_cls``'s methods; or a function of the worker) on every tensor-parallel
        rank at once; each rank's result, rank 0's first. A worker missing ``timeout`` shuts the
        engine down."""
        self._resources.check_open()
        if not (isinstance(method, str) or callable(method)):
            raise TypeError(f"method must be a method name or a callable, got {method!r:.80}")
        if timeout is not None:
            check_number("timeout", timeout, lo=0, lo_open=True)
        deadline = timeout and time.monotonic() + timeout
        runner, name = self._resources.runner, method
        if callable(method):
            method = functools.partial(_on_worker, method)
        elif method in VLLM_WORKER_METHODS and not hasattr(runner.worker, method):
            method = VLLM_WORKER_METHODS[method]  # a function of each rank's runner
        elif "." not in method and not callable(getattr(runner.worker, method, None)):
            raise ValueError(f"method={method!r} is not a method of the workers (nanovllm's "
                             "ModelRunner, with worker_extension_cls's methods)")
        with self.core.lock:
            try:
                results = call_every_rank(self.core, method, args, kwargs, deadline)
                if name == "reload_weights":  # the cached prefixes' K/V came from the old ones
                    self.core.scheduler.block_manager.reset_prefix_cache()
                return results
            except TypeError as e:
                raise TypeError(f"collective_rpc: {e}") from None
            except RuntimeError as e:
                if "raised" in str(e):
                    raise RuntimeError(f"collective_rpc: {e}") from None
                raise

    def update_weights(self, weights) -> None:
        """Replaces the weights in place with (checkpoint name, tensor) pairs as a transformers
        model's ``named_parameters()`` gives them (any subset); every name and shape checked first
        (a ValueError, nothing changed), storage kept (graphs stay valid), the prefix cache reset
        (``features.weight_update``)."""
        self._resources.check_open()
        REGISTRY.get("method", "update_weights")(self, weights)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``enable_sleep_mode=True``): gives the device memory of the KV cache
        and the weights back; level 1 keeps the weights in host memory, level 2 discards them
        (reload with ``update_weights``). Refused while requests are unfinished; requests are
        refused until ``wake_up`` (``features.sleep``)."""
        self._resources.check_open()
        REGISTRY.get("method", "sleep")(self, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Takes back the device memory of ``tags`` (``"weights"``, ``"kv_cache"``; None: both)."""
        self._resources.check_open()
        REGISTRY.get("method", "wake_up")(self, tags)

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache are asleep."""
        return REGISTRY.get("method", "is_sleeping")(self)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        self._resources.check_open()
        if self.frontend["profiler_config"] is None:
            raise RuntimeError("start_profile() needs profiler_config={'profiler': 'torch', "
                               "'torch_profiler_dir': ...}")
        self.collective_rpc(_start_profile, args=(self.frontend["profiler_config"], profile_prefix))

    def stop_profile(self) -> None:
        self.collective_rpc(_stop_profile)  # which checks the engine is open

    def get_metrics(self) -> list:
        """vLLM's metrics over the engine's life (``nanovllm.v1.metrics.reader``); they are counted
        with ``disable_log_stats=False``, as in vLLM."""
        self._resources.check_open()
        if "metrics" not in self.features:
            raise ValueError("get_metrics() needs the engine's statistics: create the LLM with "
                             "disable_log_stats=False (vLLM's LLM disables them by default)")
        with self.core.lock:
            metrics = self.features["metrics"].stats.snapshot(self.core.scheduler,
                                                              self.config.model)
            if "speculative" in self.features:
                from nanovllm.features.speculative import spec_decode_metrics
                metrics += spec_decode_metrics(self.core, dict(metrics[0].labels))
            return metrics

    def _add_request_by_id(self, request_id: str, prompt, params: SamplingParams | None = None,
                           arrival_time=None, lora_request=None, tokenization_kwargs=None,
                           trace_headers=None, priority: int = 0) -> None:
        """vLLM's ``add_request``; the id is reserved first, so two threads cannot both take it."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        refuse_unsupported(priority, lora_request=lora_request,
                           tokenization_kwargs=tokenization_kwargs, trace_headers=trace_headers,
                           arrival_time=arrival_time)  # arrival: the engine's clock
        if self._step_requests.setdefault(request_id, None) is not None:
            raise ValueError(f"request_id {request_id!r} is already running")
        try:
            ids, text = self._parse_prompt(0, prompt)
            params = self.get_default_sampling_params() if params is None else params
            self._step_requests[request_id] = self._add(ids, text, self._admitted(params), 0,
                                                        None, request_id, incremental=True)
        except BaseException:
            del self._step_requests[request_id]
            raise

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None,
             chat_template_content_format: str = "auto", lora_request=None,
             mm_processor_kwargs=None) -> list[RequestOutput]:
        """``generate`` on a conversation (a list of {"role", "content"} messages) or a list of
        them, rendered by the tokenizer's chat template or ``chat_template``."""
        self._resources.check_open()
        refuse_unsupported(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError("chat_template_content_format must be 'auto' or 'string', "
                             f"got {chat_template_content_format!r}")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r}")
        if self.tokenizer is None or not (chat_template or self.tokenizer.chat_template):
            raise ValueError("chat needs a tokenizer with a chat template (or chat_template=...)")
        single = isinstance(messages, list) and messages and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        if not isinstance(conversations, list) or not all(
                isinstance(c, list) and all(isinstance(m, dict) for m in c) for c in conversations):
            raise TypeError(f"messages must be a conversation (a list of dicts) or a list of them, "
                            f"got {messages!r:.80}")
        where = "messages[{1}]" if single else "messages[{0}][{1}]"
        conversations = [[text_message(where.format(c, i), m) for i, m in enumerate(conversation)]
                         for c, conversation in enumerate(conversations)]
        options = dict(chat_template=chat_template, tools=tools,
                       add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message,
                       **(chat_template_kwargs or {}))
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, **options)
                 for c in conversations]
        # the template writes the special tokens (BOS and the like) itself
        prompts = [{"prompt_token_ids": encode(self.tokenizer, f"conversation {c}", text,
                                               add_special_tokens=False)}
                   for c, text in enumerate(texts)]
        return self._generate(self._add_requests(prompts, sampling_params, texts=texts), use_tqdm)


def _start_profile(runner, options: dict, prefix: str | None) -> None:
    """This rank's torch profiler, writing ``[prefix_]rank<r>.<time>.pt.trace.json[.gz]`` when
    stopped."""
    import torch.profiler as tp
    if "profiler" in runner.extensions:
        raise RuntimeError("start_profile(): the profiler is running already")
    name = f"{prefix}_rank{runner.rank}" if prefix else f"rank{runner.rank}"
    flags = {ours: options.get(theirs, default)
             for theirs, (ours, default) in _PROFILER_FLAGS.items()}
    handler = tp.tensorboard_trace_handler(options["torch_profiler_dir"], name,
                                           use_gzip=flags.pop("use_gzip"))
    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA]
                                              if runner.config.device == "cuda" else [])
    profile = tp.profile(activities=activities, on_trace_ready=handler, **flags)
    runner.extensions["profiler"] = TorchProfiler(profile)


def _stop_profile(runner) -> None:
    if "profiler" not in runner.extensions:
        raise RuntimeError("stop_profile() without start_profile()")
    runner.extensions.pop("profiler").close()


class TorchProfiler:
    """A rank's "profiler" extension; closed (its trace written) by ``stop_profile`` or when the
    engine exits."""

    def __init__(self, profile):
        self.profile = profile
        profile.start()

    def close(self) -> None:
        self.profile.stop()


def text_message(where: str, message: dict) -> dict:
    """``message`` with its content as one string (vLLM's "string" format: text parts joined by
    newlines, None as ""); a role that is not a string, or content other than text, is refused
    naming ``where``."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise ValueError(f"{where}['role'] must be a string, got {role!r:.60}")
    if content is None or isinstance(content, str):
        return {**message, "content": content or ""}
    if not isinstance(content, list):
        raise ValueError(f"{where}['content'] must be a string or a list of parts, "
                         f"got {content!r:.60}")
    texts = []
    for j, part in enumerate(content):
        text = (part if isinstance(part, str)
                else part.get("text") if isinstance(part, dict) else None)
        if (not isinstance(text, str)
                or isinstance(part, dict) and part.get("type", "text") != "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}['content'][{j}] has type {kind!r}: only text parts are "
                             f"supported (nanovllm is text-only), got {part!r:.60}")
        texts.append(text)
    return {**message, "content": "\n".join(texts)}


def update_config(runner, overrides: dict) -> None:
    """vLLM's ``Worker.update_config``, for ``{"load_config": {"load_format": ...}}`` (what
    ``reload_weights`` then loads); any other override is refused by name."""
    load = overrides.get("load_config") if isinstance(overrides, dict) else None
    if not (isinstance(load, dict) and overrides.keys() == {"load_config"}
            and load.keys() == {"load_format"}):
        raise ValueError("update_config takes {'load_config': {'load_format': ...}} only, "
                         f"got {overrides!r:.80}")
    if load["load_format"] not in (formats := CHOICES["load_format"]):  # Config's
        raise ValueError(f"load_format must be one of {formats}, got {load['load_format']!r}")
    runner.config = runner.config.derive(load_format=load["load_format"])


def reload_weights(runner) -> None:
    """vLLM's ``Worker.reload_weights``: the weights again, in place, by the load format (a model
    started with ``load_format="dummy"`` loads its checkpoint after ``update_config``)."""
    if runner.config.load_format == "dummy":
        load_dummy_weights(runner.model, runner.config.seed + runner.rank)
    else:
        load_model(runner.model, runner.config.model)


# vLLM's worker methods that scripts call by name through collective_rpc
VLLM_WORKER_METHODS = {"update_config": update_config, "reload_weights": reload_weights}


def _on_worker(method, runner, *args, **kwargs):
    """``collective_rpc``'s function of the worker, run on a rank."""
    return method(runner.worker, *args, **kwargs)


def step_output(request, tokenizer) -> RequestOutput | None:
    """What ``LLMEngine.step`` reports of a request by its ``output_kind``: None while nothing is
    new (FINAL_ONLY: until it finishes); DELTA: what is new since the last report (the prompt
    logprobs in the first)."""
    kind = request.seqs[0].sampling_params.output_kind
    count = sum(seq.num_completion_tokens for seq in request.seqs)
    if not request.finished and (count == request.num_reported
                                 or kind is RequestOutputKind.FINAL_ONLY):
        return None
    output = request_output(request, tokenizer)
    if kind is RequestOutputKind.DELTA:
        output.prompt_logprobs = None if request.num_reported else output.prompt_logprobs
        output.outputs = [_delta(request, i, out) for i, out in enumerate(output.outputs)]
    request.num_reported = count
    return output


def _delta(request, i: int, out: CompletionOutput) -> CompletionOutput:
    """Completion ``i``'s part not reported yet, its text held back as a stream's is."""
    tokens, chars = request.reported[i]
    holdback = stop_holdback(request.seqs[i].sampling_params.stop_strings, bool(out.finish_reason))
    end = max(chars, len(out.text) - holdback)
    request.reported[i] = (len(out.token_ids), end)
    return replace(out, text=out.text[chars:end], token_ids=out.token_ids[tokens:],
                   logprobs=None if out.logprobs is None else out.logprobs[tokens:])
