"""The user-facing class: ``LLM(model, **config).generate(prompts, sampling_params)``."""
from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False, *, lora_request=None,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search: for each prompt (a string, a token-id list, or a {"prompt": ...} /
        {"prompt_token_ids": ...} dict), a ``BeamSearchOutput`` of its ``params.beam_width`` best sequences, best
        first by ``cum_logprob / len(tokens) ** length_penalty``, ``tokens`` being prompt + completion. Each step is
        one ``generate`` call over all live beams (see ``nanovllm.beam_search``). ``use_tqdm``: a bar over the
        steps; ``concurrency_limit``: how many prompts are searched at a time (all by default)."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported by nanovllm (no LoRA)")
        return beam_search(self, prompts, params, use_tqdm=use_tqdm, concurrency_limit=concurrency_limit)
