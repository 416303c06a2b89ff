"""vLLM's ``vllm.v1`` module paths."""
