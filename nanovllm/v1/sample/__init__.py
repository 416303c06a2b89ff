"""vLLM's ``vllm.v1.sample`` module path."""
