"""nanovllm: a small, readable offline LLM inference engine in the architecture of nano-vllm."""
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
