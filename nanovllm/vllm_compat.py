"""vLLM's API where it differs from nano-vllm's, kept out of the engine: its engine keywords (``config_from_kwargs``),
``EngineArgs``, and the ``LLMEngine`` methods vLLM scripts call (``VllmCompatMixin``: ``add_request`` by request id,
``chat``, the accessors)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanovllm.config import Config
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.engine.llm_engine import LLMEngine

logger = logging.getLogger("nanovllm")

# vLLM engine keywords that change nothing here, whatever their value: accepted, and named in one log line
IGNORED_KEYWORDS = {
    "trust_remote_code": "the models are nanovllm's own code",
    "code_revision": "the models are nanovllm's own code",
    "swap_space": "preempted sequences are recomputed",
    "disable_log_stats": "no stats logging",
    "max_seq_len_to_capture": "decode graphs cover max_model_len",
    "max_context_len_to_capture": "decode graphs cover max_model_len",
    "disable_custom_all_reduce": "torch.distributed's all-reduce only",
    "compilation_config": "no torch.compile",
    "use_v2_block_manager": "one block manager",
    "disable_async_output_proc": "outputs are processed as each step ends",
    "disable_cascade_attn": "no cascade attention",
    "prefix_caching_hash_algo": "prefix blocks are keyed by xxhash",
    "max_logprobs": "logprobs are bounded by the vocabulary",
    "served_model_name": "no server",
    "limit_mm_per_prompt": "text-only models",
    "mm_processor_kwargs": "text-only models",
    "allowed_local_media_path": "text-only models",
    "use_tqdm_on_load": "no progress bar while loading",
}
# vLLM engine keywords accepted only at values that change nothing here (vLLM's default among them):
# name -> (those values; why any other is refused)
UNSUPPORTED_KEYWORDS = {
    "quantization": ((None,), "no quantized weights or kernels"),
    "cpu_offload_gb": ((0,), "the weights stay on the device"),
    "kv_cache_memory_bytes": ((None,), "the KV cache is sized by num_kvcache_blocks or gpu_memory_utilization"),
    "pipeline_parallel_size": ((1,), "tensor parallelism only"),
    "enable_expert_parallel": ((False,), "experts are sharded along their intermediate size, as tensor parallelism "
                                         "shards them, not placed whole on ranks"),
    "data_parallel_size": ((1,), "one replica per engine (nanovllm.distributed.ray runs several)"),
    "distributed_executor_backend": ((None, "mp", "uni"), "tensor-parallel ranks are local processes"),
    "speculative_config": ((None,), "no speculative decoding"),
    "enable_lora": ((False, None), "no LoRA adapters"),
    "max_lora_rank": ((), "no LoRA adapters"),
    "max_loras": ((), "no LoRA adapters"),
    "enable_chunked_prefill": ((None, True), "prefills are always chunked"),
    "scheduling_policy": (("fcfs",), "first come, first served only"),
    "preemption_mode": ((None, "recompute"), "preempted sequences are recomputed"),
    "num_scheduler_steps": ((1,), "one forward per schedule"),
    "enable_sleep_mode": ((False,), "no sleep mode"),
    "enable_prompt_embeds": ((False,), "prompts are text or token ids"),
    "logits_processors": ((None, []), "no logits processors"),
    "task": ((None, "auto", "generate"), "text generation only"),
    "runner": (("auto", "generate"), "text generation only"),
    "convert": (("auto", "none"), "text generation only"),
    "model_impl": (("auto", "vllm"), "the models are nanovllm's own code"),
    "tokenizer_mode": (("auto", "hf"), "the tokenizer is transformers' AutoTokenizer, fast when it exists"),
    "config_format": (("auto", "hf"), "config.json in Hugging Face's format only"),
    "hf_overrides": ((None, {}), "the model's config.json is used as it is"),
    "rope_scaling": ((None,), "the model's config.json is used as it is"),
    "rope_theta": ((None,), "the model's config.json is used as it is"),
    "guided_decoding_backend": ((None, "auto", "xgrammar"), "structured outputs are compiled with xgrammar"),
    "structured_outputs_config": ((None, {}, {"backend": "auto"}, {"backend": "xgrammar"}),
                                  "structured outputs are compiled with xgrammar; disable_any_whitespace is set per "
                                  "request (StructuredOutputsParams)"),
    "disable_sliding_window": ((False,), "sliding-window layers always attend within their window; pass "
                                         "max_model_len <= the window for full attention"),
}
# vLLM's names -> ours
KEYWORD_ALIASES = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}


def config_from_kwargs(cls: type[Config], model: str, kwargs: dict) -> Config:
    """``cls(model, **kwargs)`` after vLLM's aliases are renamed and its keywords that change nothing here are
    dropped (named in one log line); a TypeError names every unknown keyword, a ValueError an unsupported value."""
    for alias, name in KEYWORD_ALIASES.items():
        if alias in kwargs:
            if name in kwargs:
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
                        "vLLM's that change nothing here (nanovllm.vllm_compat.IGNORED_KEYWORDS)")
    config = cls(model, **{k: v for k, v in kwargs.items() if k not in ignored})
    if ignored:
        logger.info("ignored vLLM engine argument(s), no effect in nanovllm: %s",
                    "; ".join(f"{name} ({why})" for name, why in sorted(ignored.items())))
    return config


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


class VllmCompatMixin:
    """``LLMEngine``'s methods that only vLLM's API has; they use the engine's ``core``, ``config``, ``tokenizer``
    and its request-id table ``_step_requests``."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs):
        """vLLM's: ``LLMEngine.from_engine_args(EngineArgs(model=..., **keywords))``."""
        return cls(engine_args.model, **engine_args.kwargs)

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
        """vLLM's ``llm_engine.model_config``."""
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
        """vLLM's: SamplingParams with the fields (GENERATION_CONFIG_FIELDS) that the ``generation_config``
        keyword's generation_config.json sets; what ``generate`` and ``chat`` use when ``sampling_params`` is None."""
        choice = self.config.generation_config
        source = {"auto": self.config.model, "vllm": None}.get(choice, choice)
        return SamplingParams(**(generation_config_defaults(source) if source is not None else {}))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block (vLLM's); refused (False) while requests are running."""
        with self.core.lock:
            return self.core.scheduler.block_manager.reset_prefix_cache()

    def _add_request_by_id(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None,
                           lora_request=None, tokenization_kwargs=None, trace_headers=None, priority: int = 0) -> None:
        """vLLM's ``add_request(request_id, prompt, params)``: ``step()`` reports the request under that id, which
        is reserved before the prompt is checked so that two threads cannot both take it."""
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
