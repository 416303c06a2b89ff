"""The user-facing class: ``LLM(model, **config).generate(prompts, sampling_params)``."""
from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    pass
