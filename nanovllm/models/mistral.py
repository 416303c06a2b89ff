"""Mistral: the Llama decoder; its sliding window is refused by ``check_config`` when it is shorter
than max_model_len (our kernels attend to the whole context)."""
from nanovllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
