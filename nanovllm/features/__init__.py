"""The features, registered in the core's registry by name (nothing here imports one): what
installs each (an engine keyword, a request's field), the model classes and vLLM names they add."""
import functools
import importlib

from nanovllm.plugins import REGISTRY

_FEATURES = {  # name: (its class, what it registers with)
    "fp8": ("fp8:Fp8", dict(keywords=("quantization",))),
    "sleep": ("sleep:Sleep", dict(keywords=("enable_sleep_mode",))),
    "worker_extension": ("worker_extension:WorkerExtension",
                         dict(keywords=("worker_extension_cls",))),
    "structured_outputs": ("structured_output:StructuredOutputs",
                           dict(request_fields=("structured_outputs",), first_rank_only=True)),
    "logits_processors": ("logits_processors:LogitsProcessors",
                          dict(keywords=("logits_processors",), first_rank_only=True,
                               request_fields=("allowed_token_ids", "bad_words"))),
    "metrics": ("metrics:Metrics", dict(keywords=("disable_log_stats",), first_rank_only=True)),
    "speculative": ("speculative:SpeculativeDecoding",
                    dict(keywords=("speculative_config",), first_rank_only=True)),
}
for _name, (_target, _meta) in _FEATURES.items():
    REGISTRY.register("feature", _name, f"nanovllm.features.{_target}", **_meta)
REGISTRY.register("model", "Qwen3MoeForCausalLM", "nanovllm.features.moe:Qwen3MoeForCausalLM")
# vLLM's names (``nanovllm.X``, ``nanovllm.sampling_params.X``) and the frontend's methods
_NAMES = {"StructuredOutputsParams": "structured_output", "BeamSearchParams": "beam_search",
          "BeamSearchOutput": "beam_search", "BeamSearchSequence": "beam_search"}
for _name, _module in _NAMES.items():
    REGISTRY.register("name", _name, f"nanovllm.features.{_module}:{_name}")
for _name, _target in {"beam_search": "beam_search:beam_search", "sleep": "sleep:sleep",
                       "wake_up": "sleep:wake_up", "is_sleeping": "sleep:is_sleeping",
                       "update_weights": "weight_update:update_weights"}.items():
    REGISTRY.register("method", _name, f"nanovllm.features.{_target}")


def import_by_name(value: str, what: str):
    """The object a "module.Name" or "module:Name" string names (vLLM's way to pass a class by
    name); a ValueError says why ``what`` cannot be imported."""
    module, _, name = value.rpartition(":" if ":" in value else ".")
    try:
        return functools.reduce(getattr, name.split("."), importlib.import_module(module))
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{what} cannot be imported: {e}") from None
