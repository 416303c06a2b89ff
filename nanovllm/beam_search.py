"""Beam search, vLLM's ``LLM.beam_search`` and its rules, built on ``generate``: each step is one call over every
live beam (``max_tokens=1``, ``logprobs=2 * beam_width``), whose logprob entries are the beams' candidates; the
prefix cache makes the shared prefixes cheap.
"""
from __future__ import annotations

from dataclasses import dataclass

from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import prompt_list
from nanovllm.sampling_params import SamplingParams, check_bool, check_int, check_number


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters; each step samples at ``temperature`` (its token joins the candidates)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def verify(self) -> None:
        """Raises ``ValueError``/``TypeError`` naming the first bad field."""
        check_int("beam_width", self.beam_width, lo=1)
        check_int("max_tokens", self.max_tokens, lo=1)
        check_number("temperature", self.temperature, lo=0.0)
        check_number("length_penalty", self.length_penalty)  # any finite number
        for name in ("ignore_eos", "include_stop_str_in_output"):
            check_bool(name, getattr(self, name))

    __post_init__ = verify


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` (prompt + completion), each step's logprob entry, their ``cum_logprob``; ``text``,
    ``finish_reason`` ("stop": EOS, "length") and ``stop_reason`` are set when it is returned."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    lora_request: None = None  # vLLM's field; nanovllm has no LoRA
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """One prompt's result: its ``beam_width`` best sequences, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's length-penalized score: ``cumulative_logprob / len ** length_penalty``, a final EOS not counted."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


def beam_search(llm, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """The ``params.beam_width`` best sequences of each prompt, in prompt order; ``concurrency_limit`` prompts
    are searched at a time (all by default)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    params.verify()  # again: fields may have been assigned since construction
    if concurrency_limit is not None:
        check_int("concurrency_limit", concurrency_limit, lo=1)
    vocab_size = llm.config.hf_config.vocab_size
    if 2 * params.beam_width > vocab_size:
        raise ValueError(f"beam_width must be <= half the vocabulary size {vocab_size} (each step ranks "
                         f"2 * beam_width candidates per beam), got {params.beam_width}")
    tokenizer = llm.tokenizer
    prompt_ids = [llm._parse_prompt(i, p)[0] for i, p in enumerate(prompt_list(prompts))]  # as generate reads them
    eos_token_id = llm.config.eos_token_ids[0] if llm.config.eos_token_ids else None  # the model's own

    def score(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty)

    step_params = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width)
    chunk = concurrency_limit or max(1, len(prompt_ids))
    outputs = []
    for start in range(0, len(prompt_ids), chunk):
        searches = [_Search(ids) for ids in prompt_ids[start:start + chunk]]
        for _ in tqdm(range(params.max_tokens), desc="Beam search", unit="token", disable=not use_tqdm):
            if not _step(llm, searches, step_params, params, eos_token_id, score):
                break
        for search in searches:
            for beam in search.live:
                beam.finish_reason = "length"
            best = sorted(search.finished + search.live, key=score, reverse=True)[:params.beam_width]
            for beam in best:
                beam.text = _text(tokenizer, beam, params.include_stop_str_in_output)
            outputs.append(BeamSearchOutput(sequences=best))
    return outputs


class _Search:
    """One prompt's search: its live beams (one length, best first) and the finished ones."""

    def __init__(self, prompt_ids: list[int]):
        self.live = [BeamSearchSequence(tokens=list(prompt_ids), logprobs=[])]
        self.finished: list[BeamSearchSequence] = []


def _step(llm, searches: list[_Search], step_params: SamplingParams, params: BeamSearchParams,
          eos_token_id: int | None, score) -> bool:
    """One token for every live beam (one ``generate`` call); False when no beam was left to extend."""
    max_model_len = llm.config.max_model_len
    for search in searches:  # a beam at max_model_len cannot grow: it ends there ("length")
        for beam in search.live:
            if len(beam.tokens) >= max_model_len:
                beam.finish_reason = "length"
                search.finished.append(beam)
        search.live = [beam for beam in search.live if beam.finish_reason is None]
    beams = [beam for search in searches for beam in search.live]
    if not beams:
        return False
    results = iter(llm.generate([{"prompt_token_ids": beam.tokens} for beam in beams], step_params, use_tqdm=False))
    for search in searches:
        candidates = []
        for beam in search.live:
            entry = _step_entry(next(results))
            for token_id, logprob in entry.items():
                new = BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [entry],
                                         cum_logprob=beam.cum_logprob + float(logprob))
                if token_id == eos_token_id and not params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", eos_token_id
                    search.finished.append(new)
                else:
                    candidates.append(new)
        search.live = sorted(candidates, key=score, reverse=True)[:params.beam_width]
    return True


def _step_entry(out) -> dict:
    """The {token id: Logprob} entry of a one-token ``generate`` output."""
    completion = out.outputs[0]
    if completion.finish_reason == "error" or not completion.logprobs:
        raise RuntimeError(f"a beam search step produced no token (finish_reason {completion.finish_reason!r})")
    return dict(completion.logprobs[0])


def _text(tokenizer, beam: BeamSearchSequence, include_stop_str: bool) -> str:
    if tokenizer is None:
        return ""
    tokens = beam.tokens[:-1] if beam.finish_reason == "stop" and not include_stop_str else beam.tokens
    return tokenizer.decode(tokens)
