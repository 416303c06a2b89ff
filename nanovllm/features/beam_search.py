"""Beam search, a feature: vLLM's ``LLM.beam_search`` on ``generate``: each step is one call over
every live beam (``max_tokens=1``, ``logprobs=2 * beam_width``) whose logprob entries are the
candidates; the prefix cache shares the prefixes."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import prompt_list
from nanovllm.sampling_params import SamplingParams, check_bool, check_int, check_number


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters; each step's token sampled at ``temperature`` joins the
    candidates."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def verify(self) -> None:
        check_int("beam_width", self.beam_width, lo=1)
        check_int("max_tokens", self.max_tokens, lo=1)
        check_number("temperature", self.temperature, lo=0.0)
        check_number("length_penalty", self.length_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            check_bool(name, getattr(self, name))

    __post_init__ = verify


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` are prompt + completion; ``finish_reason`` is "stop" (EOS) or
    "length"."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    lora_request: None = None  # vLLM's field; nanovllm has no LoRA
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """One prompt's ``beam_width`` best sequences, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's ``cumulative_logprob / len ** length_penalty``, a final EOS not counted."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


# of len ** |length_penalty|: room left for the cumulative logprob
_MAX_LOG_LENGTH_FACTOR = math.log(1e280)


def _check_length_penalty(length_penalty: float, max_model_len: int) -> None:
    """Refuses a ``length_penalty`` for which the score overflows (or divides by zero) up to
    ``max_model_len``."""
    if abs(length_penalty) * math.log(max_model_len) > _MAX_LOG_LENGTH_FACTOR:
        raise ValueError(f"length_penalty={length_penalty} makes the beam score overflow at "
                         f"lengths up to max_model_len={max_model_len}: |length_penalty| must "
                         f"be <= {_MAX_LOG_LENGTH_FACTOR / math.log(max_model_len):.4g}")


def beam_search(llm, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """Each prompt's result in prompt order, searching ``concurrency_limit`` prompts at a time
    (default all)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    params.verify()  # fields may have been assigned since construction
    if concurrency_limit is not None:
        check_int("concurrency_limit", concurrency_limit, lo=1)
    _check_length_penalty(params.length_penalty, llm.config.max_model_len)
    vocab_size = llm.config.hf_config.vocab_size
    if 2 * params.beam_width > vocab_size:
        raise ValueError(f"beam_width must be <= half the vocabulary size {vocab_size}, "
                         f"got {params.beam_width}")
    prompt_ids = [llm._parse_prompt(i, p)[0] for i, p in enumerate(prompt_list(prompts))]
    eos_token_id = llm.config.eos_token_ids[0] if llm.config.eos_token_ids else None

    def score(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id,
                                     params.length_penalty)

    step_params = SamplingParams(temperature=params.temperature, max_tokens=1,
                                 logprobs=2 * params.beam_width)
    chunk = concurrency_limit or max(1, len(prompt_ids))
    outputs = []
    for start in range(0, len(prompt_ids), chunk):
        searches = [_Search([BeamSearchSequence(list(ids), [])])
                    for ids in prompt_ids[start:start + chunk]]
        for _ in tqdm(range(params.max_tokens), desc="Beam search", unit="token",
                      disable=not use_tqdm):
            if not _step(llm, searches, step_params, params, eos_token_id, score):
                break
        for search in searches:
            for beam in search.live:
                beam.finish_reason = "length"
            best = sorted(search.finished + search.live, key=score,
                          reverse=True)[:params.beam_width]
            for beam in best:
                beam.text = _text(llm.tokenizer, beam, params.include_stop_str_in_output)
            outputs.append(BeamSearchOutput(sequences=best))
    return outputs


@dataclass
class _Search:
    live: list[BeamSearchSequence]  # of one length, best first
    finished: list[BeamSearchSequence] = field(default_factory=list)


def _step(llm, searches: list[_Search], step_params: SamplingParams, params: BeamSearchParams,
          eos_token_id: int | None, score) -> bool:
    """One token for every live beam; False when no beam was left to extend."""
    for search in searches:  # a beam at max_model_len cannot grow
        for beam in search.live:
            if len(beam.tokens) >= llm.config.max_model_len:
                beam.finish_reason = "length"
                search.finished.append(beam)
        search.live = [beam for beam in search.live if beam.finish_reason is None]
    beams = [beam for search in searches for beam in search.live]
    if not beams:
        return False
    results = iter(llm.generate([{"prompt_token_ids": beam.tokens} for beam in beams], step_params,
                                use_tqdm=False))
    for search in searches:
        candidates = []
        for beam in search.live:
            completion = next(results).outputs[0]
            if completion.finish_reason == "error" or not completion.logprobs:
                raise RuntimeError("a beam search step produced no token "
                                   f"(finish_reason {completion.finish_reason!r})")
            entry = dict(completion.logprobs[0])
            for token_id, logprob in entry.items():
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [entry],
                                         cum_logprob=beam.cum_logprob + float(logprob))
                if token_id == eos_token_id and not params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", eos_token_id
                    search.finished.append(new)
                else:
                    candidates.append(new)
        search.live = sorted(candidates, key=score, reverse=True)[:params.beam_width]
    return True


def _text(tokenizer, beam: BeamSearchSequence, include_stop_str: bool) -> str:
    if tokenizer is None:
        return ""
    drop_eos = beam.finish_reason == "stop" and not include_stop_str
    return tokenizer.decode(beam.tokens[:-1] if drop_eos else beam.tokens)
