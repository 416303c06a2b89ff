"""vLLM's offline API where it differs from nano-vllm's: ``EngineArgs`` and its command-line flags,
``ModelConfig``, the per-call keywords nanovllm refuses, ``generation_config.json`` defaults, the vLLM form of
``add_request`` (by request id), ``chat`` and the accessors vLLM scripts call. ``LLMEngine`` inherits them."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass

from nanovllm.config import KEYWORD_ALIASES, Config
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

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
    """The methods of ``LLMEngine`` that exist for vLLM's scripts."""

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
    def llm_engine(self) -> VllmCompatMixin:
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

    def _add_request_by_id(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None,
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
