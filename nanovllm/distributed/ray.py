"""vLLM-style data parallelism on Ray (``features.ray``) with this package's ``LLM``."""
from nanovllm.entrypoints.llm import LLM
from nanovllm.features import ray as _ray


class DataParallelLLM(_ray.DataParallelLLM):
    engine_class = LLM


class LLMPredictor(_ray.LLMPredictor):
    engine_class = LLM


__all__ = ["DataParallelLLM", "LLMPredictor"]
