"""vLLM's ``RequestOutput`` and ``CompletionOutput``, as ``generate`` and ``chat`` return them;
they also answer nano-vllm's dict keys (``out["text"]``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

from nanovllm.logprobs import Logprob

logger = logging.getLogger("nanovllm")


class DictLike:
    """Dict-style access to a dataclass's fields and to ``_ALIASES`` (key -> a function of the
    object); ``_OPTIONAL`` fields are absent keys while they are None."""

    _ALIASES: dict = {}
    _OPTIONAL: tuple[str, ...] = ()

    def keys(self) -> list[str]:
        names = [f.name for f in fields(self)] + list(self._ALIASES)
        return [k for k in names if not (k in self._OPTIONAL and self[k] is None)]

    def __getitem__(self, key: str):
        if key in self._ALIASES:
            return self._ALIASES[key](self)
        if not isinstance(key, str) or key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def items(self) -> list[tuple[str, object]]:
        return [(k, self[k]) for k in self.keys()]

    def values(self) -> list:
        return [self[k] for k in self.keys()]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())


@dataclass
class CompletionOutput(DictLike):
    """``finish_reason``: "stop", "length", "abort" or "error"; ``stop_reason``: the stop string
    or token id that ended it (None for EOS, length, abort)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    _OPTIONAL = ("logprobs",)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics(DictLike):
    """In seconds (``time.perf_counter`` values)."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    time_to_first_token: float | None
    total_time: float | None


@dataclass
class RequestOutput(DictLike):
    """``prompt`` is None for token prompts; the keys add completion 0's ``text``, ``token_ids``,
    ``finish_reason`` and ``logprobs``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # why a completion ended with finish_reason "error"
    error: str | None = field(default=None, repr=False)

    _ALIASES = {name: (lambda o, name=name: getattr(o.outputs[0], name))
                for name in ("text", "token_ids", "finish_reason", "logprobs")}
    _OPTIONAL = ("prompt_logprobs", "error", "logprobs")


def _init_dropping_unknown(self, *args, **kwargs):
    """vLLM's forward compatibility: the constructor logs and drops keywords of a later vLLM (the
    engine builds its outputs with the dataclass's own ``__init__``, ``__init__.__wrapped__``)."""
    if unknown := sorted(kwargs.keys() - _NAMES):
        logger.warning("RequestOutput: ignoring extra arguments: %s", unknown)
        kwargs = {k: v for k, v in kwargs.items() if k in _NAMES}
    _init_dropping_unknown.__wrapped__(self, *args, **kwargs)


_NAMES = {f.name for f in fields(RequestOutput) if f.init}
_init_dropping_unknown.__wrapped__ = RequestOutput.__init__
RequestOutput.__init__ = _init_dropping_unknown
