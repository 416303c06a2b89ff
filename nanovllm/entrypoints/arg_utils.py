"""vLLM's engine keywords (what the frontend's ``engine_kwargs`` maps onto the core's ``Config``):
aliases, no-op keywords, unsupported values, the frontend's own; ``hf_overrides``,
``profiler_config``; ``EngineArgs``, which makes them CLI flags."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os

from transformers import PretrainedConfig

import nanovllm.config
from nanovllm.config import Config
from nanovllm.sampling_params import check_bool

logger = logging.getLogger("nanovllm")

# vLLM engine keywords that change nothing here at any value: name -> why (logged)
IGNORED_KEYWORDS = {
    **dict.fromkeys(("trust_remote_code", "code_revision"), "the models are nanovllm's own code"),
    **dict.fromkeys(("max_seq_len_to_capture", "max_context_len_to_capture"),
                    "decode graphs cover max_model_len"),
    **dict.fromkeys(("limit_mm_per_prompt", "mm_processor_kwargs", "allowed_local_media_path"),
                    "text-only models"),
    "swap_space": "preempted sequences are recomputed",
    "disable_custom_all_reduce": "torch.distributed's all-reduce only",
    "compilation_config": "no torch.compile",
    "use_v2_block_manager": "one block manager",
    "disable_async_output_proc": "outputs are processed each step",
    "prefix_caching_hash_algo": "prefix blocks are keyed by xxhash",
    "served_model_name": "no server",
    "use_tqdm_on_load": "no progress bar while loading",
}
# vLLM engine keywords accepted only at the values that change nothing here:
# name -> (those values, why)
UNSUPPORTED_KEYWORDS = {
    "cpu_offload_gb": ((0,), "the weights stay on the device"),
    "kv_cache_memory_bytes": ((None,), "sized by num_kvcache_blocks or gpu_memory_utilization"),
    "pipeline_parallel_size": ((1,), "tensor parallelism only"),
    "enable_expert_parallel": ((False,), "experts are sharded along their intermediate size"),
    "data_parallel_size": ((1,), "one replica per engine (nanovllm.distributed.ray runs several)"),
    "distributed_executor_backend": ((None, "mp", "uni"),
                                     "tensor-parallel ranks are local processes"),
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
                                  "structured outputs use xgrammar; disable_any_whitespace is set "
                                  "per request"),
    "disable_sliding_window": ((False,),
                               "sliding windows are kept; max_model_len <= the window avoids them"),
}
KEYWORD_ALIASES = {"block_size": "kvcache_block_size",
                   "num_gpu_blocks_override": "num_kvcache_blocks"}


# the frontend's keywords: (default, what takes it)
FRONTEND_KEYWORDS = {"revision": None, "tokenizer_revision": None, "download_dir": None,
                     "hf_token": None, "hf_overrides": None, "generation_config": "auto",
                     "profiler_config": None, "quantization": None, "logits_processors": None,
                     "worker_extension_cls": None, "enable_sleep_mode": False,
                     "disable_log_stats": True, "speculative_config": None}


def apply_hf_overrides(hf_config: PretrainedConfig, overrides) -> PretrainedConfig:
    """vLLM's ``hf_overrides``: a dict merged into the model's config, or a function returning the
    config. A rope dict or ``rope_theta`` alone is merged into transformers 5's ``rope_parameters``,
    keeping the other."""
    if overrides is None:
        return hf_config
    if callable(overrides):
        if not isinstance(hf_config := overrides(hf_config), PretrainedConfig):
            raise TypeError(f"hf_overrides must return the model's config, got {hf_config!r:.80}")
        return hf_config
    if not isinstance(overrides, dict):
        raise TypeError(f"hf_overrides must be a dict or a callable, got {overrides!r:.80}")
    overrides, rope = dict(overrides), getattr(hf_config, "rope_parameters", None)
    if (isinstance(rope, dict)
            and overrides.keys() & {"rope_scaling", "rope_parameters", "rope_theta"}):
        new = dict(overrides.pop("rope_parameters", None) or overrides.pop("rope_scaling", None)
                   or rope)
        if "rope_theta" in overrides:  # the override wins over the one rope_parameters holds
            new["rope_theta"] = overrides.pop("rope_theta")
        new.setdefault("rope_theta", rope.get("rope_theta"))
        overrides["rope_parameters"] = new
    fields = {**hf_config.to_dict(), **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        fields.pop("layer_types", None)  # derived from the number of layers: made again
    return type(hf_config).from_dict(fields)  # derived fields follow, as transformers makes them


# profiler_config's torch profiler flags: vLLM's name -> (torch.profiler's keyword, vLLM's default)
_PROFILER_FLAGS = {"torch_profiler_with_stack": ("with_stack", True),
                   "torch_profiler_with_flops": ("with_flops", False),
                   "torch_profiler_record_shapes": ("record_shapes", False),
                   "torch_profiler_with_memory": ("profile_memory", False),
                   "torch_profiler_use_gzip": ("use_gzip", True)}
_PROFILER_KEYS = ("profiler", "torch_profiler_dir", *_PROFILER_FLAGS)


# vLLM's ``ProfilerConfig`` (``from nanovllm.config import ProfilerConfig``): the torch profiler's
# fields, with vLLM's defaults; ``LLM(profiler_config=...)`` takes it or a dict of its fields
ProfilerConfig = dataclasses.make_dataclass("ProfilerConfig", [
    ("profiler", str | None, None), ("torch_profiler_dir", str, ""),  # "torch", or None: none
    *((name, bool, default) for name, (_, default) in _PROFILER_FLAGS.items())])
ProfilerConfig.__module__ = __name__  # 3.11: make_dataclass names no module (pickle needs one)
nanovllm.config.ProfilerConfig = ProfilerConfig  # at vLLM's path, vllm.config; the core has no use


def profiler_options(config: dict | ProfilerConfig | None) -> dict | None:
    """vLLM's ``ProfilerConfig`` for the torch profiler, checked, its directory made absolute;
    None: no profiling."""
    if config is None:
        return None
    if isinstance(config, ProfilerConfig):
        config = dataclasses.asdict(config)
    if not isinstance(config, dict):
        raise TypeError(f"profiler_config must be a dict or a ProfilerConfig, got {config!r:.80}")
    if unknown := sorted(config.keys() - set(_PROFILER_KEYS)):
        raise ValueError(f"profiler_config keys {unknown} are not supported by nanovllm; "
                         f"supported: {', '.join(_PROFILER_KEYS)}")
    profiler, directory = config.get("profiler"), config.get("torch_profiler_dir")
    if profiler not in (None, "torch"):
        raise ValueError(f"profiler_config profiler={profiler!r} is not supported by nanovllm: "
                         "'torch' only")
    if directory and profiler != "torch":
        raise ValueError("torch_profiler_dir is only applicable when profiler is set to 'torch'")
    if profiler == "torch" and not directory:
        raise ValueError("torch_profiler_dir must be set when profiler is 'torch'")
    for name in config.keys() & _PROFILER_FLAGS.keys():
        check_bool(f"profiler_config {name}", config[name])
    if profiler is None:
        return None
    return {**config, "torch_profiler_dir": os.path.abspath(os.path.expanduser(directory))}


def refuse_unsupported(priority=None, *, num_prompts: int | None = None, **keywords) -> None:
    """A ValueError for the first of vLLM's per-call keywords (``lora_request``, ...) that is not
    None, or for a ``priority`` other than 0 (or a list of ``num_prompts`` zeros)."""
    many = isinstance(priority, (list, tuple))
    if many and num_prompts is not None and len(priority) != num_prompts:
        raise ValueError(f"The lengths of prompts ({num_prompts}) and priority ({len(priority)}) "
                         "must be the same")
    if priority is not None and any(priority if many else [priority]):
        raise ValueError(f"priority={priority!r} is not supported: first come, first served only")
    for name, value in keywords.items():
        if value is not None:
            raise ValueError(f"{name}={value!r:.60} is not supported by nanovllm")




class EngineArgs:
    """vLLM's ``EngineArgs(model=..., **keywords)`` for ``LLMEngine.from_engine_args``;
    ``add_cli_args`` and ``from_cli_args`` make the keywords command-line flags
    (``--max-model-len``, ...)."""

    def __init__(self, model: str = "nanovllm:demo", **kwargs):
        self.model, self.kwargs = model, kwargs

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """``--model`` and a flag per Config field, dashed; unset flags keep the defaults."""
        parser.add_argument("--model", default="nanovllm:demo",
                            help="checkpoint directory, Hub id or preset")
        for name, type_ in _cli_fields().items():
            parse = (dict(action=argparse.BooleanOptionalAction) if type_ is bool
                     else dict(type=type_, nargs="+") if name in _LIST_FLAGS
                     else dict(type=type_))
            parser.add_argument(*_SHORT_FLAGS.get(name, ()), "--" + name.replace("_", "-"),
                                default=None, **parse)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = _cli_fields()
        return cls(args.model, **{k: v for k, v in vars(args).items()
                                  if k in names and v is not None})


def _cli_fields() -> dict[str, type]:
    """Config's keywords and vLLM's aliases of them, with the type their flag parses."""
    fields = {f.name: str(f.type).split(" | ") for f in dataclasses.fields(Config)
              if f.init and f.name not in ("model", "hf_config", "features")}
    fields.update({name: ["str"] for name in FRONTEND_KEYWORDS if name not in _FRONTEND_TYPES})
    fields.update(_FRONTEND_TYPES)
    fields.update({alias: fields[name] for alias, name in KEYWORD_ALIASES.items()})
    return {name: next((t for type_name, t in _FLAG_TYPES.items() if type_name in parts), str)
            for name, parts in fields.items()}


# vLLM's short spellings, and the flags that take several values (``--logits-processors A B``)
_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "quantization": ("-q",)}
_LIST_FLAGS = ("logits_processors",)
# a field's type name -> its flag's parser; the first in a field's type wins
_FLAG_TYPES = {"dict": json.loads, "str": str, "bool": bool, "int": int, "float": float}




# the frontend keywords' flag types (the others are strings)
_FRONTEND_TYPES = {"hf_overrides": ["dict"], "profiler_config": ["dict"],
                   "enable_sleep_mode": ["bool"], "disable_log_stats": ["bool"]}


def speculative_options(frontend: dict, kwargs: dict) -> None:
    """``speculative_config`` checked, its feature installed first (it replaces the engine's core),
    and what it needs of the engine: no logits processors; with tensor-parallel ranks, async
    scheduling off unless asked for (the ranks take each overlapped step's tokens from rank 0's
    sampler, which a verify step does not run)."""
    from nanovllm.features.speculative import parse_speculative_config
    options = {"speculative_config": parse_speculative_config(frontend["speculative_config"])}
    kwargs["features"] = (("speculative", options), *kwargs["features"])
    if frontend["logits_processors"]:
        raise ValueError("logits_processors are not supported with speculative_config (the "
                         "verify step samples each proposed position without them)")
    tp = kwargs.get("tensor_parallel_size")
    if isinstance(tp, int) and tp > 1 and kwargs.get("async_scheduling") is None:
        kwargs["async_scheduling"] = False  # True is refused by the feature
