"""nanovllm: a small, readable offline LLM inference engine in the architecture of nano-vllm. This
package's face is the frontend, vLLM's API (``nanovllm.entrypoints``); the features' names are
imported when first used."""
import logging

from nanovllm.entrypoints.arg_utils import EngineArgs
from nanovllm.entrypoints.llm import LLM, LLMEngine
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.plugins import REGISTRY
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "Logprob", "TextPrompt", "TokensPrompt",
           "BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput"]


def __getattr__(name: str):
    """vLLM's names that features define (``StructuredOutputsParams``, ``BeamSearchParams``)."""
    if name in REGISTRY.names("name"):
        return REGISTRY.get("name", name)
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")


_logger = logging.getLogger("nanovllm")
if not _logger.handlers:  # INFO lines show by default, as in vLLM
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s nanovllm: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
