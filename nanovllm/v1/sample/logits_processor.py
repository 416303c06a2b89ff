"""vLLM's ``vllm.v1.sample.logits_processor``: the logits-processor interface
(``nanovllm.logits_processor``)."""
from nanovllm.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    RequestLogitsProcessor,
    process_dict_updates,
)

__all__ = ["AdapterLogitsProcessor", "BatchUpdate", "LogitsProcessor", "MoveDirectionality",
           "RequestLogitsProcessor", "process_dict_updates"]
