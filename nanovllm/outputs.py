"""What ``generate`` and ``chat`` return: vLLM's ``RequestOutput`` and ``CompletionOutput`` (its attributes,
its types), which also answer nano-vllm's and earlier nanovllm's keys (``out["text"]``, ``out["token_ids"]``:
completion 0's), and vLLM's ``Logprob`` entries, which are floats too (``sum(entry.values())`` and
``math.exp(entry[t])`` work as they did when entries held plain floats)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


class Logprob(float):
    """A token's log probability, with vLLM's ``logprob``, ``rank`` (1 is the most likely token of the whole
    vocabulary) and ``decoded_token`` (its text; None without a tokenizer)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


class _Keys:
    """Key access to a dataclass's fields (``out["text"]``, ``out.get(...)``, ``"logprobs" in out``, ``dict(out)``,
    ``out.items()``, iteration over the keys),
    plus the aliases in ``_ALIASES`` (key -> a function of the object); ``_OPTIONAL`` fields count as absent
    keys while they are None, as they were absent from the dicts earlier versions returned."""

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
class CompletionOutput(_Keys):
    """One completion of a request (vLLM's): ``index`` among its ``n``, the text (cut at a stop string),
    its token ids, ``cumulative_logprob`` (the sum of the chosen tokens' logprobs; None unless logprobs were
    asked for), ``logprobs`` (per token, {token id: Logprob} of the top k and the chosen token), why it ended
    (``finish_reason``: "stop", "length", "abort" or "error") and ``stop_reason`` (the stop string or stop
    token id that ended it; None for EOS, length, abort)."""

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
class RequestMetrics(_Keys):
    """Timings of a request (seconds; times are ``time.perf_counter`` values)."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    time_to_first_token: float | None
    total_time: float | None


@dataclass
class RequestOutput(_Keys):
    """One request's result (vLLM's): its id, its prompt (the text, the rendered prompt for ``chat``, None for
    token prompts), the prompt's token ids and logprobs (per position: None for the first, then {token id:
    Logprob}; None unless asked for), its ``outputs`` (the n completions), whether it finished, how many prompt
    tokens came from the prefix cache, its timings. Keys: these fields, and completion 0's ``text``,
    ``token_ids``, ``finish_reason``, ``logprobs`` (nano-vllm's), and ``error`` when a completion failed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = field(default=None, repr=False)  # why a completion ended with finish_reason "error"

    _ALIASES = {"text": lambda o: o.outputs[0].text, "token_ids": lambda o: o.outputs[0].token_ids,
                "finish_reason": lambda o: o.outputs[0].finish_reason, "logprobs": lambda o: o.outputs[0].logprobs}
    _OPTIONAL = ("prompt_logprobs", "error", "logprobs")
