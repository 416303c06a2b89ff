"""nano-vllm's ``LLMEngine``: checks prompts and sampling parameters, admits them to the core."""
from __future__ import annotations

import itertools
import weakref
from collections import deque
from dataclasses import replace
from time import perf_counter

from tqdm.auto import tqdm
from transformers import set_seed

from nanovllm.config import Config
from nanovllm.engine.core import EngineCore
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.outputs import Request, request_output
from nanovllm.engine.overlap import OverlapEngineCore
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.worker_group import EngineResources, WorkerGroup
from nanovllm.outputs import RequestOutput
from nanovllm.plugins import REGISTRY, Feature, features_of_params
from nanovllm.sampling_params import MAX_SEED, SamplingParams
from nanovllm.utils.distributed import forget_in_forked_child
from nanovllm.utils.loader import eos_token_ids, load_tokenizer


def prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a list of strings, token-id lists or dicts, "
                        f"got {type(prompts).__name__}")
    return list(prompts)


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        config = Config(model, **kwargs)
        set_seed(config.seed)  # Python's, NumPy's and torch's generators, as vLLM seeds them
        self.tokenizer = (None if config.skip_tokenizer_init
                          else load_tokenizer(config.tokenizer or config.model))
        eos_ids = eos_token_ids(config.model, config.hf_config, self.tokenizer)
        config = config.derive(eos_token_ids=eos_ids)
        self._resources = resources = EngineResources()
        self._finalizer = weakref.finalize(self, resources.close)
        forget_in_forked_child(self, lambda engine: engine._finalizer.detach())  # the parent frees
        try:
            resources.workers = WorkerGroup(config) if config.tensor_parallel_size > 1 else None
            group = resources.workers.connect() if resources.workers else None
            resources.runner = ModelRunner(config, 0, group)
        except BaseException as e:
            resources.shut_down_and_raise(e, self._finalizer)
        self.config = config.derive(num_kvcache_blocks=resources.runner.num_kvcache_blocks,
                                    max_model_len=resources.runner.max_model_len)
        core = OverlapEngineCore if self.config.async_scheduling else EngineCore
        self.core = core(self.config, resources, self._finalizer, [])
        self._request_ids = itertools.count()
        self._step_requests: dict[str, Request | None] = {}  # add_request's; None: admitting
        self.features: dict[str, Feature] = {}  # installed, by name
        for (name, _), feature in zip(self.config.features, resources.runner.features):
            self.install(name, feature)

    def install(self, name: str, feature: Feature | None = None) -> Feature:
        with self.core.lock:  # once, between steps, whichever thread admits first
            if name not in self.features:
                feature = feature or REGISTRY.get("feature", name)(self.config, {})
                feature.setup_engine(self)
                self.features[name] = feature
            return self.features[name]

    model_runner = property(lambda self: self._resources.runner)  # rank 0's; None once shut down
    workers = property(lambda self: self._resources.workers)
    scheduler = property(lambda self: self.core.scheduler)
    requests = property(lambda self: self.core.requests, doc="The admitted requests, by seq_id.")

    def is_finished(self) -> bool:
        return self.core.is_finished()

    def exit(self):
        """Frees the engine's processes and memory; safe to call twice, and after a failure."""
        if getattr(self, "core", None) is not None:
            self.core.shutdown()  # lets go of a device wait for a bitmask, then runs the finalizer
        else:
            self._finalizer()

    shutdown = exit

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()

    def _add(self, prompt_ids: list[int], text: str | None, params: SamplingParams, index: int,
             stream: deque | None, request_id: str | None = None,
             incremental: bool = False) -> Request:
        """Admits a checked prompt (``_admitted`` params); ``incremental``: step() reports text."""
        completions = [params if params.seed is None or i == 0 else
                       replace(params, seed=(params.seed + i) % MAX_SEED) for i in range(params.n)]
        seqs = [Sequence(prompt_ids, sp, self.config.kvcache_block_size) for sp in completions]
        if params.prompt_logprobs is not None:  # one completion computes them for the request
            seqs[0].prompt_logprobs = [None] * len(prompt_ids)
        incremental = incremental and self.tokenizer is not None
        wanted = params.detokenize and (stream is not None or params.stop_strings or incremental)
        detokenizers = [IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                               params.skip_special_tokens) if wanted else None
                        for _ in seqs]
        while request_id is None or self._step_requests.get(request_id) is not None:
            request_id = str(next(self._request_ids))  # not one that a caller of add_request holds
        request = Request(index, prompt_ids, seqs, request_id, text, detokenizers, stream,
                          incremental)
        self.core.add(request, params)
        return request

    def _admitted(self, sampling_params: SamplingParams) -> SamplingParams:
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got "
                            f"{type(sampling_params).__name__}")
        sp = sampling_params.clone()
        sp.verify()
        vocab_size, most = self.config.hf_config.vocab_size, self.config.max_logprobs
        limit = vocab_size if most == -1 else min(most, vocab_size)  # a larger top k would fail
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            if (getattr(sp, name) or 0) > limit:  # vLLM's wording, then ours
                raise ValueError(f"Requested {kind} logprobs of {getattr(sp, name)}, which is "
                                 f"greater than max allowed: {limit} ({name}; "
                                 f"max_logprobs={most}, vocabulary size {vocab_size})")
        if bad := [t for t in sp.stop_token_ids if t >= vocab_size]:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab_size})")
        if sp.stop_strings:
            require_tokenizer(self.tokenizer, "stop strings")
        for name in features_of_params(sp):
            self.install(name)
        for feature in self.features.values():
            feature.check_request(sp, self)
        return sp

    def generate(self, prompts,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Completions of ``prompts`` in order; ``sampling_params``: one, one per prompt or None."""
        return self._generate(self._add_requests(prompts, sampling_params), use_tqdm)

    def _generate(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        try:
            with tqdm(total=len(requests), desc="Generating", dynamic_ncols=True,
                      disable=not use_tqdm) as pbar:
                pending, speed = requests, {"prefill": "0tok/s", "decode": "0tok/s"}
                while pending:
                    t, num_tokens = perf_counter(), self.core.interruptible_step()
                    rate = abs(num_tokens) / (perf_counter() - t)
                    speed["prefill" if num_tokens > 0 else "decode"] = f"{rate:.0f}tok/s"
                    pbar.set_postfix({**speed, **self.core.progress}, refresh=False)
                    pending, before = [r for r in pending if not r.finished], len(pending)
                    pbar.update(before - len(pending))
        finally:
            self.core.release(requests)
        return [request_output(r, self.tokenizer) for r in requests]

    def _add_requests(self, prompts, sampling_params, stream: deque | None = None,
                      texts: list[str] | None = None) -> list[Request]:
        """Checks all prompts and params before admitting any; ``texts``: token-id prompts' text."""
        prompts = prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.default_sampling_params()] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
                isinstance(sp, SamplingParams) for sp in sampling_params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, "
                            "one per prompt")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} "
                             "sampling params")
        if stream is not None:
            require_tokenizer(self.tokenizer, "streaming")
        admitted = [self._admitted(sp) for sp in sampling_params]
        checked = [self._parse_prompt(i, p) for i, p in enumerate(prompts)]
        return [self._add(ids, texts[i] if texts else text, sp, i, stream)
                for i, ((ids, text), sp) in enumerate(zip(checked, admitted))]

    def _parse_prompt(self, i: int, prompt) -> tuple[list[int], str | None]:
        return parse_prompt(i, prompt, self.tokenizer, self.config)

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams()


def require_tokenizer(tokenizer, what: str):
    if tokenizer is None:
        raise ValueError(f"{what} need a tokenizer, but the engine has skip_tokenizer_init=True")


def encode(tokenizer, what: str, text: str, add_special_tokens: bool = True) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: {e.reason} {text[e.start]!r} "
                         f"at index {e.start}") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def parse_prompt(i: int, prompt, tokenizer, config) -> tuple[list[int], str | None]:
    if isinstance(prompt, dict):
        if unknown := sorted(set(prompt) - {"prompt", "prompt_token_ids"}):
            raise ValueError(f"prompt {i} has unsupported keys {unknown}")
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
            if not isinstance(prompt, (list, tuple)):  # a string here is not to be tokenized
                raise TypeError(f"prompt {i}'s prompt_token_ids must be a list of ints, "
                                f"got {prompt!r:.80}")
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise TypeError(f"prompt {i}'s 'prompt' must be a string, got {prompt!r:.80}")
        else:
            raise ValueError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids'")
    text = prompt if isinstance(prompt, str) else None
    if text is not None:
        require_tokenizer(tokenizer, "string prompts (pass token ids instead)")
        prompt = encode(tokenizer, f"prompt {i}", prompt)
    elif not isinstance(prompt, (list, tuple)) or not all(type(t) is int for t in prompt):
        raise TypeError(f"prompt {i} must be a string, a list of ints or a dict, "
                        f"got {prompt!r:.80}")
    if not prompt:
        raise ValueError(f"prompt {i}: the decoder prompt cannot be empty")
    vocab_size = config.hf_config.vocab_size
    if bad := [t for t in prompt if not 0 <= t < vocab_size]:
        raise ValueError(f"prompt {i}: token id {bad[0]} is out of vocabulary "
                         f"(ids {bad[:5]} outside [0, {vocab_size}))")
    if len(prompt) >= (limit := config.max_model_len):
        full = config.num_kvcache_blocks * config.kvcache_block_size == limit
        cache = f" (the whole KV cache holds {limit} tokens)" if full else ""
        raise ValueError(f"prompt {i} (length {len(prompt)}) plus at least 1 output token is "
                         f"longer than the maximum context length: max_model_len={limit}{cache}; "
                         f"this model's maximum context length is {limit} tokens (vLLM's words)")
    return list(prompt), text
