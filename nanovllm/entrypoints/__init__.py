"""The frontend: vLLM's API over the core and the features."""
