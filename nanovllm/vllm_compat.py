"""vLLM's API where it differs from nano-vllm's: its engine keywords (``config_from_kwargs``), ``EngineArgs``,
and the ``LLMEngine`` methods only vLLM has (``VllmCompatMixin``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pickle
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PretrainedConfig

from nanovllm.config import Config
from nanovllm.engine.worker_group import JOIN_TIMEOUT_S, WorkerDiedError
from nanovllm.inputs import encode
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams, check_bool, check_number

if TYPE_CHECKING:
    from nanovllm.engine.llm_engine import LLMEngine

logger = logging.getLogger("nanovllm")

# vLLM engine keywords that change nothing here at any value: name -> why (logged)
IGNORED_KEYWORDS = {
    **dict.fromkeys(("trust_remote_code", "code_revision"), "the models are nanovllm's own code"),
    **dict.fromkeys(("max_seq_len_to_capture", "max_context_len_to_capture"), "decode graphs cover max_model_len"),
    **dict.fromkeys(("limit_mm_per_prompt", "mm_processor_kwargs", "allowed_local_media_path"), "text-only models"),
    "swap_space": "preempted sequences are recomputed",
    "disable_log_stats": "no stats logging",
    "disable_custom_all_reduce": "torch.distributed's all-reduce only",
    "compilation_config": "no torch.compile",
    "use_v2_block_manager": "one block manager",
    "disable_async_output_proc": "outputs are processed each step",
    "disable_cascade_attn": "no cascade attention",
    "prefix_caching_hash_algo": "prefix blocks are keyed by xxhash",
    "served_model_name": "no server",
    "use_tqdm_on_load": "no progress bar while loading",
}
# vLLM engine keywords accepted only at the values that change nothing here: name -> (those values, why)
UNSUPPORTED_KEYWORDS = {
    "cpu_offload_gb": ((0,), "the weights stay on the device"),
    "kv_cache_memory_bytes": ((None,), "sized by num_kvcache_blocks or gpu_memory_utilization"),
    "pipeline_parallel_size": ((1,), "tensor parallelism only"),
    "enable_expert_parallel": ((False,), "experts are sharded along their intermediate size"),
    "data_parallel_size": ((1,), "one replica per engine (nanovllm.distributed.ray runs several)"),
    "distributed_executor_backend": ((None, "mp", "uni"), "tensor-parallel ranks are local processes"),
    "speculative_config": ((None,), "no speculative decoding"),
    "enable_lora": ((False, None), "no LoRA adapters"),
    "max_lora_rank": ((), "no LoRA adapters"),
    "max_loras": ((), "no LoRA adapters"),
    "scheduling_policy": (("fcfs",), "first come, first served only"),
    "preemption_mode": ((None, "recompute"), "preempted sequences are recomputed"),
    "num_scheduler_steps": ((1,), "one forward per schedule"),
    "enable_prompt_embeds": ((False,), "prompts are text or token ids"),
    "task": ((None, "auto", "generate"), "text generation only"),
    "runner": (("auto", "generate"), "text generation only"),
    "convert": (("auto", "none"), "text generation only"),
    "model_impl": (("auto", "vllm"), "the models are nanovllm's own code"),
    "tokenizer_mode": (("auto", "hf"), "transformers' AutoTokenizer only"),
    "config_format": (("auto", "hf"), "Hugging Face's config.json only"),
    "rope_scaling": ((None,), "config.json is used as it is"),
    "rope_theta": ((None,), "config.json is used as it is"),
    "guided_decoding_backend": ((None, "auto", "xgrammar"), "structured outputs use xgrammar"),
    "structured_outputs_config": ((None, {}, {"backend": "auto"}, {"backend": "xgrammar"}),
                                  "structured outputs use xgrammar; disable_any_whitespace is set per request"),
    "disable_sliding_window": ((False,), "sliding windows are kept; max_model_len <= the window avoids them"),
}
KEYWORD_ALIASES = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}
# generation_config.json's field -> SamplingParams'
_GENERATION_FIELDS = {name: name for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
_GENERATION_FIELDS["max_new_tokens"] = "max_tokens"


def config_from_kwargs(cls: type[Config], model: str, kwargs: dict) -> Config:
    """``cls(model, **kwargs)`` with vLLM's aliases renamed and its no-op keywords dropped (and logged); a
    TypeError names every unknown keyword. None means "not given" for an alias or a field that takes no None, as
    ``LLM(**vars(args))`` passes every flag of ``EngineArgs.add_cli_args``."""
    no_none = {f.name for f in dataclasses.fields(cls) if "None" not in str(f.type).split(" | ")} | set(KEYWORD_ALIASES)
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in no_none}
    for alias, name in KEYWORD_ALIASES.items():
        if alias in kwargs:
            if kwargs.get(name) is not None:
                raise TypeError(f"pass {name} or its alias {alias}, not both")
            kwargs[name] = kwargs.pop(alias)
    ignored = {name: IGNORED_KEYWORDS[name] for name in kwargs.keys() & IGNORED_KEYWORDS.keys()}
    for name in sorted(kwargs.keys() & UNSUPPORTED_KEYWORDS.keys()):
        accepted, why = UNSUPPORTED_KEYWORDS[name]
        if kwargs[name] not in accepted:
            only = f" (accepted: {', '.join(map(repr, accepted))})" if accepted else ""
            raise ValueError(f"{name}={kwargs[name]!r} is not supported by nanovllm: {why}{only}")
        ignored[name] = why
    public = {f.name for f in dataclasses.fields(cls) if f.init}
    if unknown := sorted(set(kwargs) - public - ignored.keys()):
        raise TypeError(f"unknown engine argument(s) {unknown}; allowed: {sorted(public - {'model'})} and "
                        "nanovllm.vllm_compat.IGNORED_KEYWORDS")
    config = cls(model, **{k: v for k, v in kwargs.items() if k not in ignored})
    if ignored:
        logger.info("ignored vLLM engine argument(s), no effect in nanovllm: %s",
                    "; ".join(f"{name} ({why})" for name, why in sorted(ignored.items())))
    return config


def apply_hf_overrides(hf_config: PretrainedConfig, overrides) -> PretrainedConfig:
    """vLLM's ``hf_overrides``: a dict merged into the model's config, or a function returning the config. A rope
    dict or ``rope_theta`` alone is merged into transformers 5's ``rope_parameters``, keeping the other."""
    if overrides is None:
        return hf_config
    if callable(overrides):
        if not isinstance(hf_config := overrides(hf_config), PretrainedConfig):
            raise TypeError(f"hf_overrides must return the model's config, got {hf_config!r:.80}")
        return hf_config
    if not isinstance(overrides, dict):
        raise TypeError(f"hf_overrides must be a dict or a callable, got {overrides!r:.80}")
    overrides, rope = dict(overrides), getattr(hf_config, "rope_parameters", None)
    if isinstance(rope, dict) and overrides.keys() & {"rope_scaling", "rope_parameters", "rope_theta"}:
        new = dict(overrides.pop("rope_parameters", None) or overrides.pop("rope_scaling", None) or rope)
        new.setdefault("rope_theta", overrides.pop("rope_theta", rope.get("rope_theta")))
        overrides["rope_parameters"] = new
    hf_config.update(overrides)
    return hf_config


# profiler_config's torch profiler flags: vLLM's name -> (torch.profiler's keyword, vLLM's default)
_PROFILER_FLAGS = {"torch_profiler_with_stack": ("with_stack", True),
                   "torch_profiler_with_flops": ("with_flops", False),
                   "torch_profiler_record_shapes": ("record_shapes", False),
                   "torch_profiler_with_memory": ("profile_memory", False),
                   "torch_profiler_use_gzip": ("use_gzip", True)}
_PROFILER_KEYS = ("profiler", "torch_profiler_dir", *_PROFILER_FLAGS)


def profiler_options(config: dict | None) -> dict | None:
    """vLLM's ``ProfilerConfig`` for the torch profiler, checked, its directory made absolute; None: no profiling."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise TypeError(f"profiler_config must be a dict, got {config!r:.80}")
    if unknown := sorted(config.keys() - set(_PROFILER_KEYS)):
        raise ValueError(f"profiler_config keys {unknown} are not supported by nanovllm; supported: "
                         f"{', '.join(_PROFILER_KEYS)}")
    profiler, directory = config.get("profiler"), config.get("torch_profiler_dir")
    if profiler not in (None, "torch"):
        raise ValueError(f"profiler_config profiler={profiler!r} is not supported by nanovllm: 'torch' only")
    if directory and profiler != "torch":
        raise ValueError("torch_profiler_dir is only applicable when profiler is set to 'torch'")
    if profiler == "torch" and not directory:
        raise ValueError("torch_profiler_dir must be set when profiler is 'torch'")
    for name in config.keys() & _PROFILER_FLAGS.keys():
        check_bool(f"profiler_config {name}", config[name])
    if profiler is None:
        return None
    return {**config, "torch_profiler_dir": os.path.abspath(os.path.expanduser(directory))}


def run_method(runner, method, args: tuple, kwargs: dict):
    """One rank's part of ``collective_rpc``: the runner's method of that name, or ``method(runner, ...)``."""
    if isinstance(method, str):
        return getattr(runner, method)(*args, **kwargs)
    return method(runner, *args, **kwargs)


def rpc_reply(runner, method, args: tuple, kwargs: dict) -> bytes:
    """A worker's pickled reply to ``collective_rpc``: (True, the result) or (False, its error)."""
    try:
        return pickle.dumps((True, run_method(runner, method, args, kwargs)))
    except Exception as e:  # the method failed, or its result does not pickle
        return pickle.dumps((False, f"{type(e).__name__}: {e}"))


def _rpc_replies(workers, deadline: float | None) -> list[tuple[bool, object]]:
    """Every worker's reply to the last ``rpc`` call, in rank order."""
    replies = []
    for rank, doorbell in enumerate(workers.doorbells, 1):
        if not doorbell.poll(None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"collective_rpc: tensor-parallel worker rank {rank} did not reply in time")
        try:
            replies.append(pickle.loads(doorbell.recv_bytes()))
        except (EOFError, OSError):
            raise workers.death_error(JOIN_TIMEOUT_S) or WorkerDiedError(f"worker rank {rank} died") from None
    return replies


def _start_profile(runner, options: dict, prefix: str | None) -> None:
    """This rank's torch profiler, writing ``[prefix_]rank<r>.<time>.pt.trace.json[.gz]`` when stopped."""
    import torch.profiler as tp
    if getattr(runner, "torch_profiler", None) is not None:
        raise RuntimeError("start_profile(): the profiler is running already")
    name = f"{prefix}_rank{runner.rank}" if prefix else f"rank{runner.rank}"
    flags = {ours: options.get(theirs, default) for theirs, (ours, default) in _PROFILER_FLAGS.items()}
    handler = tp.tensorboard_trace_handler(options["torch_profiler_dir"], name, use_gzip=flags.pop("use_gzip"))
    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if runner.config.device == "cuda" else [])
    runner.torch_profiler = tp.profile(activities=activities, on_trace_ready=handler, **flags)
    runner.torch_profiler.start()


def _stop_profile(runner) -> None:
    if (profiler := getattr(runner, "torch_profiler", None)) is None:
        raise RuntimeError("stop_profile() without start_profile()")
    runner.torch_profiler = None
    profiler.stop()


def refuse_unsupported(priority=None, *, num_prompts: int | None = None, **keywords) -> None:
    """A ValueError for the first of vLLM's per-call keywords (``lora_request``, ...) that is not None, or for a
    ``priority`` other than 0 (or a list of ``num_prompts`` zeros)."""
    many = isinstance(priority, (list, tuple))
    if many and num_prompts is not None and len(priority) != num_prompts:
        raise ValueError(f"The lengths of prompts ({num_prompts}) and priority ({len(priority)}) must be the same")
    if priority is not None and any(priority if many else [priority]):
        raise ValueError(f"priority={priority!r} is not supported: first come, first served only")
    for name, value in keywords.items():
        if value is not None:
            raise ValueError(f"{name}={value!r:.60} is not supported by nanovllm")


@dataclass(frozen=True)
class ModelConfig:
    """The fields of vLLM's ``llm_engine.model_config`` that scripts read."""

    model: str
    tokenizer: str | None
    dtype: object
    max_model_len: int
    hf_config: object


class EngineArgs:
    """vLLM's ``EngineArgs(model=..., **keywords)`` for ``LLMEngine.from_engine_args``; ``add_cli_args`` and
    ``from_cli_args`` make the keywords command-line flags (``--max-model-len``, ...)."""

    def __init__(self, model: str = "nanovllm:demo", **kwargs):
        self.model, self.kwargs = model, kwargs

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """``--model`` and a flag per Config field, dashed; unset flags keep the defaults."""
        parser.add_argument("--model", default="nanovllm:demo", help="checkpoint directory, Hub id or preset")
        for name, type_ in _cli_fields().items():
            parse = dict(action=argparse.BooleanOptionalAction) if type_ is bool else dict(type=type_)
            parser.add_argument("--" + name.replace("_", "-"), default=None, **parse)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = _cli_fields()
        return cls(args.model, **{k: v for k, v in vars(args).items() if k in names and v is not None})


def _cli_fields() -> dict[str, type]:
    """Config's keywords and vLLM's aliases of them, with the type their flag parses."""
    fields = {f.name: str(f.type).split(" | ") for f in dataclasses.fields(Config) if f.init and f.name != "model"}
    fields.update({alias: fields[name] for alias, name in KEYWORD_ALIASES.items()})
    return {name: next((t for type_name, t in _FLAG_TYPES.items() if type_name in parts), str)
            for name, parts in fields.items()}


# a field's type name -> its flag's parser; the first in a field's type wins
_FLAG_TYPES = {"dict": json.loads, "str": str, "bool": bool, "int": int, "float": float}


class VllmCompatMixin:
    """``LLMEngine``'s vLLM-only methods, on its ``core``, ``config``, ``tokenizer`` and ``_step_requests``."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs):
        return cls(engine_args.model, **engine_args.kwargs)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished, or an ``add_request`` one not yet reported finished by ``step()``."""
        return not self.core.is_finished() or bool(self._step_requests)

    def get_num_unfinished_requests(self) -> int:
        with self.core.lock:
            return len({id(r) for r in self.core.requests.values() if not r.finished})

    @property
    def llm_engine(self) -> LLMEngine:
        return self

    @property
    def model_config(self) -> ModelConfig:
        c = self.config
        return ModelConfig(c.model, c.tokenizer or c.model, c.torch_dtype, c.max_model_len, c.hf_config)

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("get_tokenizer(): the engine has no tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults (``max_tokens=16``, not nano-vllm's 64) under the fields that the ``generation_config``
        keyword's generation_config.json sets; what vLLM's forms use without params."""
        choice, fields = self.config.generation_config, {}
        path = os.path.join(self.config.model if choice == "auto" else choice, "generation_config.json")
        if choice != "vllm" and os.path.isfile(path):
            with open(path) as f:
                fields = json.load(f)
        return SamplingParams(**{"max_tokens": 16, **{
            ours: fields[theirs] for theirs, ours in _GENERATION_FIELDS.items() if fields.get(theirs) is not None}})

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached prefix block; refused (False) while requests hold blocks, unless
        ``reset_running_requests``: they are preempted first, to be recomputed from their known tokens."""
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

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
                       ) -> list:
        """vLLM's: ``method`` (a ModelRunner method's name, or a function of the runner) on every tensor-parallel
        rank at once; each rank's result, rank 0's first. A worker missing ``timeout`` shuts the engine down."""
        if not (isinstance(method, str) or callable(method)):
            raise TypeError(f"method must be a method name or a callable, got {method!r:.80}")
        if timeout is not None:
            check_number("timeout", timeout, lo=0, lo_open=True)
        deadline = timeout and time.monotonic() + timeout
        with self.core.lock:
            return self._call_every_rank(method, tuple(args), dict(kwargs or {}), deadline)

    def _call_every_rank(self, method, args: tuple, kwargs: dict, deadline: float | None = None) -> list:
        """``collective_rpc`` with the core's lock held by the caller (``sleep``, ``wake_up``)."""
        call = (method, args, kwargs)
        runner, workers = self._resources.runner, self._resources.workers
        if runner is None:
            raise RuntimeError("the engine has been shut down (exit() or a failure); create a new LLM")
        if isinstance(method, str) and not callable(getattr(runner, method, None)):
            raise ValueError(f"method={method!r} is not a method of the workers (nanovllm's ModelRunner, with "
                             "worker_extension_cls's methods)")
        if workers is not None:
            try:
                pickle.dumps(call)
            except Exception as e:
                raise TypeError(f"collective_rpc: method, args and kwargs must pickle: {e}") from None
            self.core.call_or_shut_down(workers.call, "rpc", *call)
        try:
            result = run_method(runner, *call)
        finally:
            replies = self.core.call_or_shut_down(_rpc_replies, workers, deadline) if workers else []
        for rank, (ok, value) in enumerate(replies, 1):
            if not ok:
                raise RuntimeError(f"collective_rpc: tensor-parallel worker rank {rank} raised {value}")
        return [result, *(value for _, value in replies)]

    def start_profile(self, profile_prefix: str | None = None) -> None:
        if self.config.profiler_config is None:
            raise RuntimeError("start_profile() needs profiler_config={'profiler': 'torch', 'torch_profiler_dir': ...}")
        self.collective_rpc(_start_profile, args=(self.config.profiler_config, profile_prefix))

    def stop_profile(self) -> None:
        self.collective_rpc(_stop_profile)

    def get_metrics(self) -> list:
        """vLLM's metrics over the engine's life (``nanovllm.v1.metrics.reader``)."""
        with self.core.lock:
            return self.stats.snapshot(self.core.scheduler, self.config.model)

    def _add_request_by_id(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None,
                           lora_request=None, tokenization_kwargs=None, trace_headers=None, priority: int = 0) -> None:
        """vLLM's ``add_request``; the id is reserved first, so two threads cannot both take it."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        refuse_unsupported(priority, lora_request=lora_request, tokenization_kwargs=tokenization_kwargs,
                           trace_headers=trace_headers, arrival_time=arrival_time)  # arrival: the engine's clock
        if self._step_requests.setdefault(request_id, None) is not None:
            raise ValueError(f"request_id {request_id!r} is already running")
        try:
            ids, text = self._parse_prompt(0, prompt)
            params = self.get_default_sampling_params() if params is None else params
            self._step_requests[request_id] = self._add(ids, text, self._admitted(params), 0, None, request_id,
                                                        incremental=True)
        except BaseException:
            del self._step_requests[request_id]
            raise

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True, *,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list | None = None,
             chat_template_content_format: str = "auto", lora_request=None,
             mm_processor_kwargs=None) -> list[RequestOutput]:
        """``generate`` on a conversation (a list of {"role", "content"} messages) or a list of them, rendered by
        the tokenizer's chat template or ``chat_template``."""
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
        options = dict(chat_template=chat_template, tools=tools, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, **options) for c in conversations]
        # the template writes the special tokens (BOS and the like) itself
        prompts = [{"prompt_token_ids": encode(self.tokenizer, f"conversation {c}", text, add_special_tokens=False)}
                   for c, text in enumerate(texts)]
        return self._generate(self._add_requests(prompts, sampling_params, texts=texts), use_tqdm)


def text_message(where: str, message: dict) -> dict:
    """``message`` with its content as one string (vLLM's "string" format: text parts joined by newlines, None as
    ""); a role that is not a string, or content other than text, is refused naming ``where``."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise ValueError(f"{where}['role'] must be a string, got {role!r:.60}")
    if content is None or isinstance(content, str):
        return {**message, "content": content or ""}
    if not isinstance(content, list):
        raise ValueError(f"{where}['content'] must be a string or a list of parts, got {content!r:.60}")
    texts = []
    for j, part in enumerate(content):
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str) or isinstance(part, dict) and part.get("type", "text") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}['content'][{j}] has type {kind!r}: only text parts are supported "
                             f"(nanovllm is text-only), got {part!r:.60}")
        texts.append(text)
    return {**message, "content": "\n".join(texts)}
