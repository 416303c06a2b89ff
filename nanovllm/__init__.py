"""nanovllm: a small, readable offline LLM inference engine in the architecture of nano-vllm."""
import logging

from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.vllm_compat import EngineArgs

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob", "TextPrompt", "TokensPrompt", "BeamSearchParams", "BeamSearchSequence",
           "BeamSearchOutput"]

_logger = logging.getLogger("nanovllm")
if not _logger.handlers:  # INFO lines show by default, as in vLLM
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s nanovllm: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
