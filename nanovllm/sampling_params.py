"""Per-request sampling parameters with vLLM's names and meanings (but nano-vllm's defaults ``temperature=1.0``,
``max_tokens=64``), and the structured-output constraint."""
from __future__ import annotations

import copy
import json as _json
import math
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from nanovllm.structured_checks import TOO_DEEP, check_regex, checked_schema

SAMPLING_EPS = 1e-5  # temperatures below it are greedy: 1 / T would overflow the logits
MAX_SEED = 2 ** 64  # torch.Generator.manual_seed takes [0, 2**64)
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint, compiled by xgrammar: exactly one of ``json`` (a schema, dict or
    string), ``regex``, ``choice``, ``grammar`` (EBNF) or ``json_object=True``."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # xgrammar's behaviour already
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def verify(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(CONSTRAINTS)}; "
                             f"got {', '.join(given) or 'none'}")
        for name in ("structural_tag", "whitespace_pattern"):
            if (value := getattr(self, name)) is not None:
                raise ValueError(f"structured_outputs.{name} is not supported, got {value!r:.60}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            check_bool(f"structured_outputs.{name}", getattr(self, name))
        if self.json is not None:
            try:
                self._check_json()
            except RecursionError:
                raise ValueError(TOO_DEEP) from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}")
        if self.regex is not None:
            check_regex(self.regex)
        choice = self.choice
        if choice is not None and not (isinstance(choice, (list, tuple)) and choice
                                       and all(isinstance(c, str) and c for c in choice)):
            raise TypeError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                            f"got {choice!r:.80}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True when given, got {self.json_object!r}")

    __post_init__ = verify

    def _check_json(self) -> None:
        if not isinstance(self.json, (str, dict)):
            raise TypeError(f"structured_outputs.json must be a JSON schema dict or string, got {self.json!r:.80}")
        try:
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON ({e}): {self.json!r:.80}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {self.json!r:.80}")
        try:
            _json.dumps(schema)  # the compiler is given its JSON text
        except (TypeError, ValueError) as e:
            raise TypeError(f"structured_outputs.json must be JSON-serializable ({e}): {self.json!r:.80}") from None
        checked_schema(schema)  # a ValueError naming what xgrammar would ignore

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)


class RequestOutputKind(Enum):
    """vLLM's: what ``LLMEngine.step`` reports of a request; ``generate`` returns the final output whatever it is."""

    CUMULATIVE = 0  # everything so far, at every report
    DELTA = 1       # only what is new since the last report
    FINAL_ONLY = 2  # only the finished output


@dataclass
class SamplingParams:
    """vLLM's sampling parameters (``temperature=0`` is greedy). Logprobs come from the raw model distribution,
    before temperature and penalties; completion i of ``n`` with a ``seed`` uses (seed + i) mod 2**64."""

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
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict | None = None  # for custom logits processors
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)  # at admission

    def __setattr__(self, name: str, value):
        super().__setattr__(name, value)
        for derived in _DERIVED:  # recomputed from the fields on next use
            self.__dict__.pop(derived, None)

    def verify(self) -> None:
        """Raises naming the first bad field; makes ``stop_token_ids`` a list and ``temperature`` a float."""
        check_number("temperature", self.temperature, lo=0.0)
        check_number("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        check_number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        check_int("n", self.n, lo=1)
        check_int("top_k", self.top_k, lo=-1)
        check_int("max_tokens", self.max_tokens, lo=1)
        check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name, hi in (("seed", MAX_SEED - 1), ("logprobs", None), ("prompt_logprobs", None)):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), lo=0, hi=hi)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize", "flat_logprobs"):
            check_bool(name, getattr(self, name))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self._verify_stops()
        self._verify_processor_fields()
        self.temperature = float(self.temperature)
        constraint = self.structured_outputs
        if constraint is None:
            return
        if not isinstance(constraint, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams, got {constraint!r:.80}")
        constraint.verify()
        # the grammar decides where the output ends (EOS is allowed exactly where it is complete)
        if self.ignore_eos:
            raise ValueError("ignore_eos=True cannot be honoured with structured_outputs")
        if self.min_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} cannot be honoured with structured_outputs")

    __post_init__ = verify  # at construction, and again when a request is admitted

    def _verify_stops(self) -> None:
        if not (self.stop is None or isinstance(self.stop, str) or
                (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop))):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not all(self.stop_strings):
            raise ValueError(f"stop strings must not be empty, got {self.stop!r}")
        if self.stop_strings and not self.detokenize:
            raise ValueError(f"stop strings are only supported when detokenize is True. Set detokenize=True to use "
                             f"stop (got stop={self.stop!r}, detokenize=False)")
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not _is_token_ids(ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)

    def _verify_processor_fields(self) -> None:
        """The logits processors' fields (the vocabulary is checked at admission)."""
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise TypeError(f"extra_args must be a dict, got {self.extra_args!r:.80}")
        ids, words = self.allowed_token_ids, self.bad_words
        if ids is not None and not _is_token_ids(ids):
            raise ValueError(f"allowed_token_ids must be a list of non-negative ints, got {ids!r:.80}")
        if ids is not None and not ids:
            raise ValueError(f"allowed_token_ids is not None and empty! (None allows every token), got {ids!r}")
        if words is not None and not (isinstance(words, (list, tuple)) and all(isinstance(w, str) for w in words)):
            raise TypeError(f"bad_words must be a list of strings, got {words!r:.80}")
        if words and not all(words):
            raise ValueError(f"bad_words cannot contain an empty string, got {words!r:.80}")

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
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @cached_property
    def needs_top_k_top_p(self) -> bool:
        return self.top_k > 0 or self.top_p < 1

    @cached_property
    def is_plain(self) -> bool:
        """Temperature only: the sampler's fast path."""
        return not (self.needs_top_k_top_p or self.min_p > 0 or self.needs_penalties or self.min_tokens
                    or self.seed is not None or self.logprobs is not None)


_DERIVED = tuple(name for name, value in vars(SamplingParams).items() if isinstance(value, cached_property))


def check_number(name: str, value, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi):
        bounds = f"{'(' if lo_open else '['}{lo}, {hi}{']' if hi < math.inf else ')'}"
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")


def check_int(name: str, value, lo: int, hi: int | None = None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be >= {lo}{f' and <= {hi}' if hi is not None else ''}, got {value}")


def _is_token_ids(value) -> bool:
    return isinstance(value, (list, tuple)) and all(type(t) is int and t >= 0 for t in value)


def check_bool(name: str, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters; each step's token sampled at ``temperature`` joins the candidates."""

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
