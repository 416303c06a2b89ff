"""The model registry, keyed by config.json's ``architectures``; each family is the Llama decoder with its options."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.llama import DecoderOptions, LlamaForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM


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


MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    cls.__name__: cls for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                                  Qwen3MoeForCausalLM)}


def get_model_class(hf_config) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architecture(s) {architectures}; supported: {sorted(MODEL_REGISTRY)}")
