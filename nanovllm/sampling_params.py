"""Per-request sampling parameters, with vLLM's names and meanings (nano-vllm's defaults where the two differ:
``temperature=1.0``, ``max_tokens=64``). Fields may be assigned after construction: the engine checks (``verify``)
and copies (``clone``) the object when a request is admitted, so a later assignment never reaches a running one."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import cached_property

SAMPLING_EPS = 1e-5  # temperatures below it are greedy (as in vLLM): 1 / T would overflow the logits
MAX_SEED = 2 ** 64  # torch.Generator.manual_seed takes [0, 2**64)


@dataclass
class SamplingParams:
    """``temperature=0`` is greedy. Penalties follow vLLM: ``presence_penalty`` and ``frequency_penalty``
    over the generated tokens (subtracted from the logits), ``repetition_penalty`` over prompt and generated
    tokens (logits divided when positive, multiplied when negative). ``logprobs=k`` returns the sampled
    token's logprob and the top k, from the raw model distribution (before temperature and penalties);
    ``prompt_logprobs=k`` the same for every prompt token after the first (the actual token's and the top k
    at its position; such a request computes its whole prompt, never taking it from the prefix cache).
    ``n`` completions of one prompt share its KV blocks; with a ``seed``, completion i uses (seed + i) mod 2**64."""

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

    def __setattr__(self, name: str, value):
        super().__setattr__(name, value)
        for derived in _DERIVED:  # read again from the fields on next use (the sampler reads them every step)
            self.__dict__.pop(derived, None)

    def verify(self) -> None:
        """Raises ``ValueError``/``TypeError`` naming the first bad field; normalizes ``stop_token_ids``
        to a list and ``temperature`` to a float."""
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
            if getattr(self, name) is not None:  # None: unset
                check_int(name, getattr(self, name), lo=0, hi=hi)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not (self.stop is None or isinstance(self.stop, str) or
                (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop))):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not all(self.stop_strings):
            raise ValueError(f"stop strings must not be empty, got {self.stop!r}")
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, (list, tuple)) or not all(type(t) is int and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)
        self.temperature = float(self.temperature)

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
