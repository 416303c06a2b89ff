"""The engine's public API (``generate``, ``stream``, ``chat``, ``add_request``/``step``) and life cycle; every
prompt and sampling parameter is checked here before it is admitted. The step loop is ``core.EngineCore``'s:
calls wait for their own requests only, one step at a time under its lock, so threads, a ``generate`` inside a
``stream`` loop and interleaved streams take turns."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.config import KEYWORD_ALIASES, Config
from nanovllm.engine.core import EngineCore, EngineResources
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.output_processor import Request
from nanovllm.engine.outputs import request_output
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.structured_output import StructuredOutputManager
from nanovllm.engine.worker_group import WorkerGroup
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import MAX_SEED, SamplingParams
from nanovllm.utils.loader import eos_token_ids, load_tokenizer

# generation_config.json field -> SamplingParams field (vLLM's ``get_default_sampling_params``)
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_defaults(model: str) -> dict:
    """The sampling fields a checkpoint's ``generation_config.json`` sets (none for a preset or without one)."""
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        fields = json.load(f)
    return {ours: fields[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if fields.get(theirs) is not None}


def refuse_unsupported(priority=None, **keywords) -> None:
    """vLLM's per-call keywords that nanovllm has no use for (``lora_request``, ...): a ValueError naming the
    first one that is not None; ``priority`` (one, or one per prompt) unless 0."""
    if priority is not None and any(priority if isinstance(priority, (list, tuple)) else [priority]):
        raise ValueError(f"priority={priority!r} is not supported (nanovllm schedules first come, first served)")
    for name, value in keywords.items():
        if value is not None:
            raise ValueError(f"{name}={value!r:.60} is not supported by nanovllm (it has no LoRA, no multimodal "
                             "models, no per-request tokenization options or tracing, and its own clock)")


def prompt_list(prompts) -> list:
    """``prompts`` as a list: one prompt (a string, a token-id list or a dict) becomes a list of one."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of strings, token-id lists or dicts, got {type(prompts).__name__}")
    return list(prompts)


@dataclass(frozen=True)
class ModelConfig:
    """The served model as vLLM's ``llm_engine.model_config`` shows it (the fields scripts read)."""

    model: str
    tokenizer: str | None
    dtype: object
    max_model_len: int
    hf_config: object


class EngineArgs:
    """vLLM's ``EngineArgs(model=..., **keywords)``, for ``LLMEngine.from_engine_args``: the same keywords
    as ``LLM(...)``; ``add_cli_args``/``from_cli_args`` make them command-line flags (``--max-model-len``, ...),
    as vLLM's examples parse them."""

    def __init__(self, model: str = "nanovllm:demo", **kwargs):
        self.model, self.kwargs = model, kwargs

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """A flag per engine keyword (``--model``, then Config's fields, dashed); unset flags keep the defaults."""
        parser.add_argument("--model", default="nanovllm:demo", help="checkpoint directory, Hub id or preset")
        for name, type_ in _cli_fields().items():
            flag = "--" + name.replace("_", "-")
            if type_ is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
            else:
                parser.add_argument(flag, type=type_, default=None)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = _cli_fields()
        return cls(args.model, **{k: v for k, v in vars(args).items() if k in names and v is not None})


def _cli_fields() -> dict[str, type]:
    """Config's keywords (and vLLM's aliases of them, such as block_size) with the type their flag parses."""
    fields = {f.name: f.type for f in dataclasses.fields(Config) if f.init and f.name != "model"}
    fields.update({alias: fields[name] for alias, name in KEYWORD_ALIASES.items()})
    types = {}
    for name, annotation in fields.items():
        parts = str(annotation).split(" | ")
        types[name] = str if "str" in parts else next((t for t in (bool, int, float) if t.__name__ in parts), str)
    return types


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        config = Config.from_kwargs(model, **kwargs)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        config = config.derive(eos_token_ids=eos_token_ids(config.model, config.hf_config, self.tokenizer))
        self._resources = resources = EngineResources()
        self._finalizer = weakref.finalize(self, resources.close)
        try:
            if config.tensor_parallel_size > 1:
                resources.workers = WorkerGroup(config)
            resources.runner = ModelRunner(config, 0, resources.workers.connect() if resources.workers else None)
        except BaseException as e:
            resources.shut_down_and_raise(e, self._finalizer)
        runner = resources.runner
        self.config = config.derive(num_kvcache_blocks=runner.num_kvcache_blocks, max_model_len=runner.max_model_len)
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.config.hf_config.vocab_size,
                                                          self.config.eos_token_ids)
        self.structured_outputs.bind(runner.device, self.config.max_num_seqs,
                                     resources.workers is None and bool(self.config.async_scheduling))
        self.core = EngineCore(self.config, resources, self._finalizer, [self.structured_outputs])
        self._request_ids = itertools.count()
        # requests admitted by add_request, reported by step(): {request_id: its Request} (None while admitted)
        self._step_requests: dict[str, Request | None] = {}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs):
        """vLLM's: ``LLMEngine.from_engine_args(EngineArgs(model=..., **keywords))``."""
        return cls(engine_args.model, **engine_args.kwargs)

    # ---- life cycle ------------------------------------------------------------------------
    model_runner = property(lambda self: self._resources.runner, doc="Rank 0's runner (None once shut down).")
    workers = property(lambda self: self._resources.workers, doc="The tensor-parallel workers, or None.")
    scheduler = property(lambda self: self.core.scheduler)
    requests = property(lambda self: self.core.requests, doc="{seq_id: its Request}, for the admitted requests.")

    def is_finished(self) -> bool:
        """Whether nothing is left to run (nano-vllm's; the opposite of ``has_unfinished_requests``)."""
        return self.core.is_finished()

    def has_unfinished_requests(self) -> bool:
        """Whether an admitted request has not finished, or ``add_request``'s has not been reported finished
        by ``step()`` yet (vLLM's)."""
        return not self.core.is_finished() or bool(self._step_requests)

    def get_num_unfinished_requests(self) -> int:
        """How many admitted requests have not finished (vLLM's)."""
        with self.core.lock:
            return len({id(r) for r in self.core.requests.values() if not r.finished})

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's ``llm.llm_engine``: this engine (``add_request``, ``step``, ``has_unfinished_requests``, ...)."""
        return self

    @property
    def model_config(self) -> ModelConfig:
        c = self.config
        return ModelConfig(c.model, c.tokenizer or c.model, c.torch_dtype, c.max_model_len, c.hf_config)

    def get_model_config(self) -> ModelConfig:
        """vLLM's: ``model_config``."""
        return self.model_config

    def get_tokenizer(self):
        """The tokenizer (a transformers tokenizer); a ValueError with ``skip_tokenizer_init=True`` (vLLM's)."""
        if self.tokenizer is None:
            raise ValueError("get_tokenizer(): the engine has no tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams from the checkpoint's ``generation_config.json`` (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens as max_tokens; the ``generation_config`` keyword: "vllm" for
        SamplingParams' own defaults, or another directory), the defaults elsewhere; what ``generate`` and
        ``chat`` use when ``sampling_params`` is None."""
        choice = self.config.generation_config
        source = {"auto": self.config.model, "vllm": None}.get(choice, choice)
        return SamplingParams(**(generation_config_defaults(source) if source is not None else {}))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block (vLLM's); refused (False) while requests are running."""
        with self.core.lock:
            return self.core.scheduler.block_manager.reset_prefix_cache()

    def exit(self):
        """Frees the engine's processes, shared memory and device memory (also when it is garbage-collected and
        at interpreter exit); safe to call twice, and after a failure (dead or stuck workers are killed)."""
        if getattr(self, "core", None) is not None:
            self.core.shutdown()  # a device wait for a bitmask let go, then the finalizer
        else:
            self._finalizer()

    shutdown = exit

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, *args, **kwargs) -> Request | None:
        """Admits one prompt, in either API: nano-vllm's ``add_request(prompt, sampling_params)`` (returns
        its ``Request``) or vLLM's ``add_request(request_id, prompt, params)`` (its ``RequestOutput``s come
        from ``step()``). The sampling parameters are checked and copied now (later assignments to the
        caller's object do not reach it)."""
        if len(args) >= 2 and isinstance(args[1], SamplingParams) or "sampling_params" in kwargs:
            return self._add_nano(*args, **kwargs)
        return self._add_vllm(*args, **kwargs)

    def _add_nano(self, prompt, sampling_params: SamplingParams, index: int = 0,
                  stream: deque | None = None) -> Request:
        ids, text = self._parse_prompt(index, prompt)
        request = self._add(ids, text, self._admitted(sampling_params), index, stream, incremental=True)
        self._step_requests[request.request_id] = request
        return request

    def _add_vllm(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None,
                  lora_request=None, tokenization_kwargs=None, trace_headers=None, priority: int = 0) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        refuse_unsupported(priority, lora_request=lora_request, tokenization_kwargs=tokenization_kwargs,
                           trace_headers=trace_headers, arrival_time=arrival_time)  # arrival: the engine's clock
        if self._step_requests.setdefault(request_id, None) is not None:  # reserved at once: one thread wins
            raise ValueError(f"request_id {request_id!r} is already running")
        try:
            ids, text = self._parse_prompt(0, prompt)
            params = self.get_default_sampling_params() if params is None else params
            self._step_requests[request_id] = self._add(ids, text, self._admitted(params), 0, None, request_id,
                                                        incremental=True)
        except BaseException:
            del self._step_requests[request_id]
            raise

    def _add(self, prompt_ids: list[int], text: str | None, params: SamplingParams, index: int,
             stream: deque | None, request_id: str | None = None, incremental: bool = False) -> Request:
        """Admits a checked prompt with checked (``_admitted``) sampling parameters. ``incremental``: its
        outputs' text comes from an incremental detokenizer (``step()`` reports it again and again)."""
        completions = [params if params.seed is None or i == 0 else replace(params, seed=(params.seed + i) % MAX_SEED)
                       for i in range(params.n)]
        seqs = [Sequence(prompt_ids, sp, self.config.kvcache_block_size) for sp in completions]
        if params.prompt_logprobs is not None:  # one completion computes them for the request
            seqs[0].prompt_logprobs = [None] * len(prompt_ids)
        incremental = incremental and self.tokenizer is not None
        detokenizers = [IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                        if stream is not None or params.stop_strings or incremental else None for _ in seqs]
        while request_id is None or request_id in self._step_requests and self._step_requests[request_id] is not None:
            request_id = str(next(self._request_ids))  # a fresh id, not one that a caller of add_request holds
        request = Request(index, prompt_ids, seqs, request_id, text, detokenizers, stream, incremental)
        self.core.add(request, params)
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
        if sp.structured_outputs is not None:
            self._require_tokenizer("structured outputs")
            self.structured_outputs.compile(sp.structured_outputs)  # a ValueError now if it does not compile
        return sp

    def abort_request(self, request: Request | str | Iterable[str]):
        """Ends a request's unfinished completions (finish_reason "abort") and forgets it: a ``Request``
        (nano-vllm's ``add_request``) or request ids (vLLM's); ``step()`` does not report it."""
        targets = [request] if isinstance(request, (str, Request)) else list(request)
        with self.core.lock:
            for target in targets:
                if isinstance(target, str):
                    target = self._step_requests.get(target)
                if target is not None:
                    self._step_requests.pop(target.request_id, None)
                    self.core.abort(target)

    def step(self) -> list[RequestOutput]:
        """One forward, if anything is left to run (vLLM's ``LLMEngine.step``). Returns a ``RequestOutput``
        (cumulative: everything so far) for each request admitted by ``add_request`` that gained tokens
        since the last report, or finished (also while another call, such as ``generate``, ran the steps);
        a finished one is reported once, then forgotten."""
        with self.core.lock:
            if not self.core.is_finished():
                self.core.step()
            outputs = []
            for request_id, request in list(self._step_requests.items()):
                if request is None:  # being admitted by another thread
                    continue
                count = sum(seq.num_completion_tokens for seq in request.seqs)
                if count == request.num_reported and not request.finished:
                    continue
                outputs.append(request_output(request, self.tokenizer))
                request.num_reported = count
                if request.finished:
                    self.core.forget(request)
                    del self._step_requests[request_id]
        return outputs

    # ---- the offline API -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, lora_request=None, priority: list[int] | None = None
                 ) -> list[RequestOutput]:
        """Completions of ``prompts`` (strings, token-id lists, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": ...} dicts: ``nanovllm.inputs``), in prompt order, as vLLM's ``RequestOutput``s
        (``nanovllm.outputs``). ``sampling_params``: one for all, one per prompt, or None for
        ``get_default_sampling_params()``. vLLM's ``lora_request`` and ``priority`` are refused unless None
        (or all priorities 0)."""
        refuse_unsupported(priority, lora_request=lora_request)
        return self._generate(self._add_requests(prompts, sampling_params), use_tqdm)

    def _generate(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        pbar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            pending, speed = requests, {"prefill": 0.0, "decode": 0.0}
            while pending:
                t = perf_counter()
                num_tokens = self.core.interruptible_step()[1]
                speed["prefill" if num_tokens > 0 else "decode"] = abs(num_tokens) / (perf_counter() - t)
                pbar.set_postfix({k: f"{v:.0f}tok/s" for k, v in speed.items()}, refresh=False)
                pending, before = [r for r in pending if not r.finished], len(pending)
                pbar.update(before - len(pending))
        finally:
            pbar.close()
            self.core.release(requests)
        return [request_output(r, self.tokenizer) for r in requests]

    def stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[dict]:
        """Yields new text as it is produced: dicts with ``index`` (the prompt's), ``output_index`` (which of its
        n completions), ``text`` (the new text; a token that ends inside a UTF-8 character, or text that may begin
        a stop string, waits for the next), ``token_ids`` (the new token), and ``finished`` / ``finish_reason`` on
        a completion's last piece. Leaving the loop early aborts the requests that have not finished."""
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

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True, *,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list | None = None,
             chat_template_content_format: str = "auto", lora_request=None,
             mm_processor_kwargs=None) -> list[RequestOutput]:
        """``generate`` on a conversation (a list of {"role", "content"} messages) or a list of them, rendered by
        the tokenizer's chat template (or ``chat_template``), with vLLM's keywords: ``chat_template_kwargs`` become
        template variables (``{"enable_thinking": False}``), ``tools`` go to the template, ``add_generation_prompt``
        opens the assistant's turn, ``continue_final_message`` leaves the last message open."""
        refuse_unsupported(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
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
        single = isinstance(messages, list) and messages and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        if not isinstance(conversations, list) or not all(
                isinstance(c, list) and all(isinstance(m, dict) for m in c) for c in conversations):
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of "
                            f"them, got {messages!r:.80}")
        options = dict(chat_template=chat_template, tools=tools, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, **options) for c in conversations]
        # the template writes the special tokens (BOS and the like) itself
        prompts = [{"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)} for text in texts]
        return self._generate(self._add_requests(prompts, sampling_params, texts=texts), use_tqdm)

    # ---- helpers ---------------------------------------------------------------------------
    def _add_requests(self, prompts, sampling_params, stream: deque | None = None,
                      texts: list[str] | None = None) -> list[Request]:
        """Checks every prompt and every sampling parameter before admitting any. ``texts``: the prompts'
        text where they are token ids of a known text (chat's rendered conversations)."""
        prompts = prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or \
                not all(isinstance(sp, SamplingParams) for sp in sampling_params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, one per prompt")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        if stream is not None:
            self._require_tokenizer("streaming")
        admitted = [self._admitted(sp) for sp in sampling_params]
        checked = [self._parse_prompt(i, p) for i, p in enumerate(prompts)]
        return [self._add(ids, texts[i] if texts else text, sp, i, stream)
                for i, ((ids, text), sp) in enumerate(zip(checked, admitted))]

    def _parse_prompt(self, i: int, prompt) -> tuple[list[int], str | None]:
        """Prompt ``i``'s token ids, checked against the engine, and its text (None for token ids)."""
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
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            self._require_tokenizer("string prompts (pass token ids instead)")
            prompt = self.tokenizer.encode(prompt)
        elif not isinstance(prompt, (list, tuple)) or not all(type(t) is int for t in prompt):
            raise TypeError(f"prompt {i} must be a string, a list of ints or a dict, got {prompt!r:.80}")
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        config, vocab_size = self.config, self.config.hf_config.vocab_size
        if bad := [t for t in prompt if not 0 <= t < vocab_size]:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if len(prompt) >= config.max_model_len:
            capacity = config.num_kvcache_blocks * config.kvcache_block_size
            cache = f" (the whole KV cache holds {capacity} tokens)" if capacity == config.max_model_len else ""
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; max_model_len={config.max_model_len}{cache} "
                             "leaves no room for output")
        return list(prompt), text

    def _require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{what} need a tokenizer, but the engine has skip_tokenizer_init=True")
