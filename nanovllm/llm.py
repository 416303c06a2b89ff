"""nano-vllm's module path of ``LLM`` (vLLM's API: ``nanovllm.entrypoints.llm``)."""
from nanovllm.entrypoints.llm import LLM

__all__ = ["LLM"]
