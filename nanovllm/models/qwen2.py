"""Qwen2 / Qwen2.5: the Llama decoder with biases on q, k and v (not on o, not in the MLP)."""
from transformers import PretrainedConfig

from nanovllm.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def options(config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)
