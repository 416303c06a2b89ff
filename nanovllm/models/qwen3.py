"""Qwen3: the Llama decoder with RMSNorm over each head of q and k; biases as ``attention_bias``."""
from transformers import PretrainedConfig

from nanovllm.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        bias = getattr(config, "attention_bias", False)
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
