"""The user-facing class: ``LLM(model, **config).generate(prompts, sampling_params)``."""
from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from nanovllm.engine.llm_engine import LLMEngine, refuse_unsupported


class LLM(LLMEngine):
    """An offline engine: ``LLM(model, **keywords)``, then ``generate``, ``chat``, ``stream``, ``beam_search``.

    ``model``: a local checkpoint directory, a Hugging Face Hub id (its local cache first), ``"nanovllm:demo"``
    (the tiny model shipped in the package), or a preset (``"qwen3-0.6b"``, with ``load_format="dummy"``).
    Keywords (``nanovllm.config.Config``; vLLM's names; unknown ones raise ``TypeError``):

    - ``max_num_batched_tokens`` (16384): tokens per prefill step; longer prompts are prefilled in chunks
    - ``max_num_seqs`` (512): sequences running at once
    - ``max_model_len`` (4096): prompt + output cap, lowered to what the KV cache holds (None or -1: the model's)
    - ``gpu_memory_utilization`` (0.9): CUDA: the share of the card the weights, activations and KV cache may take
    - ``tensor_parallel_size`` (1): ranks (GPUs with NCCL; CPU processes with gloo)
    - ``enforce_eager`` (False): CUDA: no CUDA Graphs
    - ``kvcache_block_size`` / vLLM's ``block_size`` (64; 256 with flash-attn): tokens per KV block
    - ``num_kvcache_blocks`` (-1: sized from memory): KV blocks
    - ``dtype`` ("auto"): "auto", "float32"/"float", "bfloat16", "float16"/"half", or a torch dtype
    - ``device`` ("auto"): "auto" (CUDA when available), "cuda", "cpu"
    - ``seed`` (0): the sampler's seed for requests without their own
    - ``attention_backend`` ("auto"): "triton", "flash-attn" or "torch"
    - ``enable_prefix_caching`` (True), ``load_format`` ("auto" or "dummy"), ``skip_tokenizer_init`` (False),
      ``tokenizer`` (a directory or Hub id other than the model's), ``revision``, ``tokenizer_revision``,
      ``download_dir``, ``hf_token`` (Hub ids), ``async_scheduling`` (None: on for CUDA),
      ``cpu_kvcache_space`` (4.0 GiB per rank on CPU), ``kv_cache_dtype`` ("auto", or "fp8": e4m3, one byte a
      value, on the Triton (compute capability 8.9 and newer) and torch attention backends),
      ``generation_config`` ("auto": the defaults of ``get_default_sampling_params`` from the model's
      generation_config.json; "vllm": SamplingParams')

    vLLM's keywords that change nothing here are accepted and logged; those it would need and nanovllm lacks
    raise ``ValueError`` naming them (``config.IGNORED_KEYWORDS``, ``config.UNSUPPORTED_KEYWORDS``).
    """

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False, *, lora_request=None,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search: for each prompt (a string, a token-id list, or a {"prompt": ...} /
        {"prompt_token_ids": ...} dict), a ``BeamSearchOutput`` of its ``params.beam_width`` best sequences, best
        first by ``cum_logprob / len(tokens) ** length_penalty``, ``tokens`` being prompt + completion. Each step is
        one ``generate`` call over all live beams (see ``nanovllm.beam_search``). ``use_tqdm``: a bar over the
        steps; ``concurrency_limit``: how many prompts are searched at a time (all by default)."""
        refuse_unsupported(lora_request=lora_request)
        return beam_search(self, prompts, params, use_tqdm=use_tqdm, concurrency_limit=concurrency_limit)
