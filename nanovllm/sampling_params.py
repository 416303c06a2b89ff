"""Per-request sampling parameters with vLLM's names and meanings, and checks naming a bad value."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from nanovllm.plugins import REGISTRY, features_of_params

SAMPLING_EPS = 1e-5  # temperatures below it are greedy: 1 / T would overflow the logits
MAX_SEED = 2 ** 64  # torch.Generator.manual_seed takes [0, 2**64)


class RequestOutputKind(Enum):
    """vLLM's: what ``LLMEngine.step`` reports of a request (``generate``: the final output)."""
    CUMULATIVE = 0  # everything so far, at every report
    DELTA = 1       # only what is new since the last report
    FINAL_ONLY = 2  # only the finished output


@dataclass
class SamplingParams:
    """vLLM's sampling parameters (``temperature=0`` is greedy). Logprobs come from the raw model
    distribution; completion i of ``n`` with a ``seed`` uses (seed + i) mod 2**64."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: no text, nothing decoded
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    flat_logprobs: bool = False  # True: logprobs in a logprobs.FlatLogprobs
    structured_outputs: object | None = None  # a StructuredOutputsParams
    extra_args: dict | None = None  # for custom logits processors
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: bad_words tokenized at admission (by the logits processors' feature)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value):
        super().__setattr__(name, value)
        for derived in _DERIVED:  # recomputed from the fields on next use
            self.__dict__.pop(derived, None)

    def verify(self) -> None:
        """Raises on the first bad field; makes stop_token_ids a list and temperature a float."""
        check_number("temperature", self.temperature, lo=0.0)
        check_number("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        check_number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        for name, lo in (("n", 1), ("top_k", -1), ("max_tokens", 1), ("min_tokens", 0)):
            check_int(name, getattr(self, name), lo=lo)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        for name, hi in (("seed", MAX_SEED - 1), ("logprobs", None), ("prompt_logprobs", None)):
            if name != "seed" and isinstance(getattr(self, name), bool):  # vLLM's: True is 1
                setattr(self, name, int(getattr(self, name)))
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), lo=0, hi=hi)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "detokenize", "flat_logprobs"):
            check_bool(name, getattr(self, name))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        stop = self.stop
        if not (stop is None or isinstance(stop, str) or
                (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop))):
            raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
        if not all(self.stop_strings):
            raise ValueError(f"stop strings must not be empty, got {self.stop!r}")
        if self.stop_strings and not self.detokenize:
            raise ValueError(f"stop strings are only supported when detokenize is True. Set "
                             f"detokenize=True to use stop (got stop={stop!r}, detokenize=False)")
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not (isinstance(ids, (list, tuple)) and all(type(t) is int and t >= 0 for t in ids)):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise TypeError(f"extra_args must be a dict, got {self.extra_args!r:.80}")
        self.temperature = float(self.temperature)
        for name in features_of_params(self):  # the fields a feature serves
            REGISTRY.get("feature", name).verify_params(self)

    __post_init__ = verify  # at construction, and again when a request is admitted

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    @cached_property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @cached_property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @cached_property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @cached_property
    def needs_top_k_top_p(self) -> bool:
        return self.top_k > 0 or self.top_p < 1

    @cached_property
    def is_plain(self) -> bool:
        """Temperature only: the sampler's fast path."""
        return not (self.needs_top_k_top_p or self.min_p > 0 or self.needs_penalties
                    or self.min_tokens or self.seed is not None or self.logprobs is not None)


_DERIVED = tuple(name for name, value in vars(SamplingParams).items()
                 if isinstance(value, cached_property))


def check_number(name: str, value, lo: float = -math.inf, hi: float = math.inf,
                 lo_open: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi):
        bounds = f"{'(' if lo_open else '['}{lo}, {hi}{']' if hi < math.inf else ')'}"
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")


def check_int(name: str, value, lo: int, hi: int | None = None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        upto = f" and <= {hi}" if hi is not None else ""
        raise ValueError(f"{name} must be >= {lo}{upto}, got {value}")


def check_bool(name: str, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def __getattr__(name: str):
    """Names features define (``StructuredOutputsParams``, ``BeamSearchParams``), loaded lazily."""
    if name in REGISTRY.names("name"):
        return REGISTRY.get("name", name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
