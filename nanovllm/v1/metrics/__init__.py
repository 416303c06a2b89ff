"""vLLM's ``vllm.v1.metrics``: ``reader`` holds the metric types."""
