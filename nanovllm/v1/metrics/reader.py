"""vLLM's ``vllm.v1.metrics.reader``: the metric types of ``LLM.get_metrics()``."""
from nanovllm.features.metrics import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
