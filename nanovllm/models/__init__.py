"""The dense model families, each the Llama decoder with its options, registered by config.json's
``architectures`` in the one registry (features add theirs: Qwen3-MoE)."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.llama import DecoderOptions, LlamaForCausalLM
from nanovllm.plugins import REGISTRY


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: biases on q, k and v only."""

    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        bias = getattr(config, "attention_bias", False)
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's options; ``sliding_window`` (when set) on every layer."""


for _cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM):
    REGISTRY.register("model", _cls.__name__, f"{_cls.__module__}:{_cls.__name__}")


def get_model_class(hf_config) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in REGISTRY.names("model"):
            return REGISTRY.get("model", arch)
    raise ValueError(f"unsupported architecture(s) {architectures}; supported: "
                     f"{REGISTRY.names('model')}")
