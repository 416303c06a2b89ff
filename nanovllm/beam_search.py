"""vLLM's ``vllm.beam_search`` names (the feature: ``nanovllm.features.beam_search``)."""
from nanovllm.features.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    get_beam_search_score,
)

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "get_beam_search_score"]
