"""vLLM v1's logits-processor interface (``vllm.v1.sample.logits_processor``), its per-request
adapter, and the built-ins for ``SamplingParams.allowed_token_ids`` and ``bad_words``."""
from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch

from nanovllm.features import import_by_name

# (output_ids, row) or (prompt_ids, output_ids, row) -> row
RequestLogitsProcessor = Callable[..., torch.Tensor]


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # index 1 -> index 2
    SWAP = auto()  # index 1 <-> index 2


@dataclass(frozen=True)
class BatchUpdate:
    """The batch's changes since the last step, applied in this order: ``removed`` indices,
    ``added`` (index, params, prompt ids, the live output ids list), ``moved`` (index 1, index 2,
    direction)."""

    batch_size: int
    removed: Sequence[int]
    added: Sequence[tuple[int, Any, list[int] | None, list[int]]]
    moved: Sequence[tuple[int, int, MoveDirectionality]]


class LogitsProcessor(ABC):
    """A batch-level logits processor: row i of ``apply``'s logits is the request at batch index
    i."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Raises ValueError for sampling params this processor refuses (called at admission)."""
        return None

    @abstractmethod
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Shapes the batch's float32 logits [batch_size, vocab], in place or not."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if ``apply`` never changes a row's argmax."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each ``apply``; None when the batch did not change."""
        raise NotImplementedError


def process_dict_updates(req_entries: dict[int, Any], batch_update: BatchUpdate | None,
                         new_state: Callable[[Any, list[int] | None, list[int]], Any]) -> bool:
    """Applies ``batch_update`` to the per-index ``req_entries`` (an added request's entry is
    ``new_state(params, prompt ids, output ids)``, None for none); returns whether they changed."""
    if not batch_update:
        return False
    updated = False
    for index, params, prompt_ids, output_ids in batch_update.added:
        if (state := new_state(params, prompt_ids, output_ids)) is not None:
            req_entries[index], updated = state, True
        elif req_entries.pop(index, None) is not None:
            updated = True
    for index in batch_update.removed:
        updated |= req_entries.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        entry_a, entry_b = req_entries.pop(a, None), req_entries.pop(b, None)
        if entry_a is not None:
            req_entries[b] = entry_a
        if entry_b is not None and direction == MoveDirectionality.SWAP:
            req_entries[a] = entry_b
        updated |= entry_a is not None or entry_b is not None
    return updated


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs per-request processors: ``new_req_logits_processor(params)`` returns a
    ``RequestLogitsProcessor``, or None to leave the request alone."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(self, params, prompt_ids: list[int] | None, output_ids: list[int]):
        if (processor := self.new_req_logits_processor(params)) is None:
            return None
        if len(inspect.signature(processor).parameters) == 3:
            return functools.partial(processor, prompt_ids, output_ids)
        return functools.partial(processor, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, processor in self.req_info.items():
            logits[index] = processor(logits[index])
        return logits


class _Builtin(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.entries: dict[int, Any] = {}

    def is_argmax_invariant(self) -> bool:
        return False


class AllowedTokenIdsLogitsProcessor(_Builtin):
    """``SamplingParams.allowed_token_ids``: only those tokens may be sampled."""

    # (rows, [rows, vocab] True = banned), kept while valid
    masks: tuple[torch.Tensor, torch.Tensor] | None = None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.entries, batch_update,
                                lambda params, _, __: params.allowed_token_ids):
            self.masks = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.entries:
            return logits
        if self.masks is None:
            banned = torch.ones(len(self.entries), logits.size(1), dtype=torch.bool)
            for i, ids in enumerate(self.entries.values()):
                banned[i, ids] = False
            self.masks = (torch.tensor(list(self.entries), device=logits.device),
                          banned.to(logits.device))
        rows, banned = self.masks
        logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
        return logits


class BadWordsLogitsProcessor(_Builtin):
    """``SamplingParams.bad_words`` (as ``bad_words_token_ids``): a word's last token is banned
    right after its other tokens (vLLM's semantics)."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.entries, batch_update,
                             lambda params, _, out: (params._bad_words_token_ids, out)
                                                    if params.bad_words else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        banned = [(index, ids[-1]) for index, (words, out) in self.entries.items() for ids in words
                  if len(ids) <= len(out) + 1 and out[len(out) - len(ids) + 1:] == ids[:-1]]
        if banned:
            logits[tuple(zip(*banned))] = float("-inf")
        return logits


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenization of bad words: each as the text's start and, if that differs but is as
    long, after a space."""
    token_ids = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        token_ids += ([plain, spaced] if spaced and spaced[0] != plain[0]
                      and len(spaced) == len(plain) else [plain])
    return token_ids


BUILTIN_LOGITS_PROCESSORS = (AllowedTokenIdsLogitsProcessor, BadWordsLogitsProcessor)


def load_logits_processors(entries) -> list[type[LogitsProcessor]]:
    """The classes of ``logits_processors``: ``LogitsProcessor`` subclasses or "module.Class" /
    "module:Class"."""
    if entries is None:
        return []
    if not isinstance(entries, (list, tuple, str)):
        raise TypeError("logits_processors must be a list of LogitsProcessor classes or "
                        f"'module.Class' names, got {entries!r:.80}")
    return [_load(entry) for entry in ([entries] if isinstance(entries, str) else entries)]


def _load(entry) -> type[LogitsProcessor]:
    cls = (import_by_name(entry, f"logits_processors entry {entry!r}") if isinstance(entry, str)
           else entry)
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise TypeError(f"logits_processors entry {entry!r:.80} is not a subclass of "
                        "nanovllm.logits_processor.LogitsProcessor")
    if inspect.isabstract(cls):
        raise TypeError(f"logits_processors entry {entry!r:.80} does not implement "
                        f"{', '.join(sorted(cls.__abstractmethods__))}")
    return cls
