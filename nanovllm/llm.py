"""The user-facing class: ``LLM(model, **config).generate(prompts, sampling_params)``."""
from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.vllm_compat import refuse_unsupported


class LLM(LLMEngine):
    """An offline engine; ``model`` is a checkpoint directory, a Hub id, ``"nanovllm:demo"`` or a preset such as
    ``"qwen3-0.6b"`` (with ``load_format="dummy"``), the keywords ``Config``'s, named as in vLLM."""

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False, *, lora_request=None,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """For each prompt, its ``params.beam_width`` best sequences, best first (vLLM's)."""
        refuse_unsupported(lora_request=lora_request)
        return beam_search(self, prompts, params, use_tqdm=use_tqdm, concurrency_limit=concurrency_limit)
