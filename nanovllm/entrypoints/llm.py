"""vLLM's ``LLM`` and ``LLMEngine`` over the core's: vLLM's keywords mapped onto ``Config`` (the
model resolved, features listed), then vLLM's methods (``engine_api``)."""
from __future__ import annotations

import dataclasses
import logging
import os

from transformers import PretrainedConfig

import nanovllm.features  # noqa: F401 (registers every feature with the core's registry)
from nanovllm.config import Config, load_hf_config
from nanovllm.demo import BUILTIN_MODELS, PREFIX, builtin_model_path
from nanovllm.engine.llm_engine import LLMEngine as CoreEngine
from nanovllm.entrypoints import hub
from nanovllm.entrypoints.arg_utils import (
    FRONTEND_KEYWORDS,
    IGNORED_KEYWORDS,
    KEYWORD_ALIASES,
    UNSUPPORTED_KEYWORDS,
    apply_hf_overrides,
    profiler_options,
    refuse_unsupported,
    speculative_options,
)
from nanovllm.entrypoints.engine_api import VllmEngineMixin
from nanovllm.models.presets import PRESETS, preset_config
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import check_bool

logger = logging.getLogger("nanovllm")


class LLMEngine(VllmEngineMixin, CoreEngine):
    """vLLM's ``LLMEngine``: ``LLMEngine(model, **vLLM's engine keywords)``, or
    ``LLMEngine.from_engine_args(EngineArgs(...))``."""

    def __init__(self, model: str = "nanovllm:demo", **kwargs):
        core_kwargs, self.frontend = engine_kwargs(model, kwargs)
        super().__init__(**core_kwargs)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, *,
                 lora_request=None, priority: list[int] | None = None) -> list[RequestOutput]:
        if lora_request is not None or priority is not None:
            num = len(prompts) if isinstance(prompts, (list, tuple)) else 1
            refuse_unsupported(priority, num_prompts=num, lora_request=lora_request)
        return super().generate(prompts, sampling_params, use_tqdm)


class LLM(LLMEngine):
    """An offline engine; ``model`` is a checkpoint directory, a Hub id, ``"nanovllm:demo"`` or a
    preset such as ``"qwen3-0.6b"`` (with ``load_format="dummy"``), the keywords vLLM's."""


def engine_kwargs(model: str, kwargs: dict) -> tuple[dict, dict]:
    """(``Config``'s keywords, the frontend's) from ``LLM(model, **kwargs)``; unknown: TypeError."""
    kwargs = _renamed(kwargs)
    given = {k: kwargs.pop(k) for k in FRONTEND_KEYWORDS.keys() & kwargs}
    frontend = {**FRONTEND_KEYWORDS, **{k: v for k, v in given.items() if v is not None}}
    _check_frontend(frontend)
    model, hf_config = _model_and_config(model, kwargs, frontend)
    kwargs["hf_config"], kwargs["features"] = hf_config, _features(hf_config, frontend)
    if frontend["speculative_config"] is not None:
        speculative_options(frontend, kwargs)
    return dict(kwargs, model=model), frontend


def _renamed(kwargs: dict) -> dict:
    """``kwargs``, vLLM's aliases renamed, no-op keywords dropped (logged), None "not given" where
    a field takes no None (``LLM(**vars(args))`` passes every flag of ``add_cli_args``)."""
    fields = {f.name: f for f in dataclasses.fields(Config) if f.init}
    no_none = {n for n, f in fields.items() if "None" not in str(f.type).split(" | ")}
    kwargs = {k: v for k, v in kwargs.items()
              if v is not None or k not in no_none | set(KEYWORD_ALIASES) | {"disable_log_stats"}}
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
    public = (fields.keys() | FRONTEND_KEYWORDS.keys()) - {"hf_config", "features"}
    if unknown := sorted(set(kwargs) - public - ignored.keys()):
        raise TypeError(f"unknown engine argument(s) {unknown}; allowed: "
                        f"{sorted(public - {'model'})} and "
                        "nanovllm.entrypoints.arg_utils.IGNORED_KEYWORDS")
    if ignored:
        logger.info("ignored vLLM engine argument(s), no effect in nanovllm: %s",
                    "; ".join(f"{name} ({why})" for name, why in sorted(ignored.items())))
    return {k: v for k, v in kwargs.items() if k not in ignored}


def _check_frontend(frontend: dict) -> None:
    choice = frontend["generation_config"]
    if not isinstance(choice, (str, os.PathLike)) or (
            choice not in ("auto", "vllm") and not os.path.isdir(choice)):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {choice!r}")
    for name in ("enable_sleep_mode", "disable_log_stats"):
        check_bool(name, frontend[name])
    if frontend["profiler_config"] is not None:
        frontend["profiler_config"] = profiler_options(frontend["profiler_config"])


def _model_and_config(model, kwargs: dict, frontend: dict) -> tuple[str, PretrainedConfig]:
    """The model's directory (or preset name) and its config, overridden."""
    model, dummy = _resolve_paths(model, kwargs, frontend), kwargs.get("load_format") == "dummy"
    if model in PRESETS and not os.path.isdir(model):
        if not dummy or not kwargs.get("skip_tokenizer_init"):
            raise ValueError(f"model {model!r} is an architecture preset (no weights, no "
                             "tokenizer): pass load_format='dummy' and skip_tokenizer_init=True")
        hf_config = preset_config(model)
    elif not os.path.isdir(model):
        raise ValueError(f"model directory {model!r} does not exist (built-in models: "
                         f"{sorted(BUILTIN_MODELS)}; presets: {sorted(PRESETS)})")
    else:
        hf_config = load_hf_config(model)
    overrides = frontend["hf_overrides"]
    return model, hf_config if overrides is None else apply_hf_overrides(hf_config, overrides)


def _resolve_paths(model, kwargs: dict, frontend: dict) -> str:
    """``model`` (and the ``tokenizer`` keyword) as local directories: a built-in model, a preset,
    a Hub id's snapshot."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path, a Hugging Face Hub id or 'nanovllm:demo', "
                        f"got {model!r}")
    model, dummy = os.fspath(model), kwargs.get("load_format") == "dummy"
    hub_options = dict(cache_dir=frontend["download_dir"], token=frontend["hf_token"])
    if model.startswith(PREFIX):
        model = builtin_model_path(model)
    elif not os.path.isdir(model):
        needs = ("config.json",) if dummy else ("config.json", "*.safetensors")
        model = hub.resolve_model(model, needs, frontend["revision"], **hub_options)
    if kwargs.get("tokenizer") is not None:
        revision = frontend["tokenizer_revision"] or frontend["revision"]
        kwargs["tokenizer"] = hub.resolve_model(os.fspath(kwargs["tokenizer"]), (), revision,
                                                **hub_options)
    return model


def _features(hf_config, frontend: dict) -> tuple[tuple[str, dict], ...]:
    """The features that the keywords (or a quantized checkpoint) ask for, with their options."""
    features = []
    if frontend["quantization"] is not None or getattr(hf_config, "quantization_config", None):
        features.append(("fp8", {"quantization": frontend["quantization"]}))
    if frontend["enable_sleep_mode"]:
        features.append(("sleep", {}))
    for name, keyword in (("worker_extension", "worker_extension_cls"),
                          ("logits_processors", "logits_processors")):
        if frontend[keyword]:  # not None, "" or []
            features.append((name, {keyword: frontend[keyword]}))
    if frontend["disable_log_stats"] is False:
        features.append(("metrics", {}))
    return tuple(features)


def create_engine_config(model: str, **kwargs) -> Config:
    """The core's ``Config`` that ``LLM(model, **kwargs)`` builds (vLLM's keywords mapped)."""
    return Config(**engine_kwargs(model, kwargs)[0])
