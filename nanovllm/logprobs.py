"""vLLM's ``vllm.logprobs``: ``Logprob``, the flat container of ``SamplingParams.flat_logprobs``,
and the ``PromptLogprobs`` / ``SampleLogprobs`` aliases."""
from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field


class Logprob(float):
    """A token's log probability (a float) with vLLM's ``rank`` (1: the most likely) and
    ``decoded_token``."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


@dataclass
class FlatLogprobs(abc.Sequence):
    """vLLM's flat container: position i's entries in columns ``start_indices[i]:end_indices[i]``;
    it reads as a list of ``{token id: Logprob}`` ({} for None)."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    @classmethod
    def of(cls, entries) -> FlatLogprobs:
        flat = cls()
        flat.extend(entries)
        return flat

    def append(self, entry: dict[int, Logprob] | None) -> None:
        self.start_indices.append(len(self.token_ids))
        for token, lp in (entry or {}).items():
            self.token_ids.append(token)
            self.logprobs.append(float(lp))
            self.ranks.append(lp.rank)
            self.decoded_tokens.append(lp.decoded_token)
        self.end_indices.append(len(self.token_ids))

    def extend(self, entries) -> None:
        for entry in entries:
            self.append(entry)

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, index: int | slice):
        if isinstance(index, slice):
            return FlatLogprobs.of(self[i] for i in range(*index.indices(len(self))))
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(self.start_indices[index], self.end_indices[index])}


PromptLogprobs = FlatLogprobs | list[dict[int, Logprob] | None]  # None: the first prompt token's
SampleLogprobs = FlatLogprobs | list[dict[int, Logprob]]
