"""The model families (``llama``'s dense decoder; features register more)."""
from nanovllm.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from nanovllm.plugins import get_model_class

__all__ = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
           "get_model_class"]
