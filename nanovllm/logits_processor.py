"""vLLM v1's logits-processor interface (``vllm.v1.sample.logits_processor``): batch-level processors that follow
the batch through ``BatchUpdate``s and shape its logits in ``apply``, the per-request adapter, and the built-ins
for ``SamplingParams.allowed_token_ids`` and ``bad_words``. ``LLM(logits_processors=[...])`` registers them."""
from __future__ import annotations

import functools
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch

RequestLogitsProcessor = Callable[..., torch.Tensor]  # (output_ids, row) or (prompt_ids, output_ids, row) -> row


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # index 1 -> index 2
    SWAP = auto()  # index 1 <-> index 2


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step: ``removed`` (indices), ``added`` ((index, params, prompt token
    ids, output token ids), the output list being the live one, extended as tokens are generated; an added index
    may be a removed request's, then not in ``removed``), and then ``moved`` ((index 1, index 2, direction))."""

    batch_size: int
    removed: Sequence[int]
    added: Sequence[tuple[int, Any, list[int] | None, list[int]]]
    moved: Sequence[tuple[int, int, MoveDirectionality]]


class LogitsProcessor(ABC):
    """A batch-level logits processor: row i of ``apply``'s logits is the request at batch index i."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Raises ValueError for sampling params this processor refuses (called at admission)."""
        return None

    @abstractmethod
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits [batch_size, vocab] float32, shaped; may be changed in place."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if ``apply`` never changes a row's argmax (greedy sampling)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each step's ``apply``; ``batch_update`` is None when the batch did not change."""
        raise NotImplementedError


def process_dict_updates(req_entries: dict[int, Any], batch_update: BatchUpdate | None,
                         new_state: Callable[[Any, list[int] | None, list[int]], Any]) -> bool:
    """Applies ``batch_update`` to per-index state ``req_entries`` (``new_state(params, prompt ids, output ids)``
    for an added request, None: no state); returns whether anything changed."""
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
    """Batch-level form of per-request processors: ``new_req_logits_processor(params)`` returns a callable
    ``(output_ids, logits_row)`` or ``(prompt_ids, output_ids, logits_row)`` -> row, or None to leave it alone."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(self, params, prompt_ids: list[int] | None, output_ids: list[int]):
        if (processor := self.new_req_logits_processor(params)) is None:
            return None
        with_prompt = len(inspect.signature(processor).parameters) == 3
        return functools.partial(processor, *((prompt_ids, output_ids) if with_prompt else (output_ids,)))

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, processor in self.req_info.items():
            logits[index] = processor(logits[index])
        return logits


class AllowedTokenIdsLogitsProcessor(LogitsProcessor):
    """``SamplingParams.allowed_token_ids``: only those tokens may be sampled."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.allowed: dict[int, list[int]] = {}
        self.masks: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, [rows, vocab] True = banned)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.allowed, batch_update, lambda params, _, __: params.allowed_token_ids):
            self.masks = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.allowed:
            return logits
        if self.masks is None:
            banned = torch.ones(len(self.allowed), logits.size(1), dtype=torch.bool)
            for i, ids in enumerate(self.allowed.values()):
                banned[i, ids] = False
            self.masks = torch.tensor(list(self.allowed), device=logits.device), banned.to(logits.device)
        rows, banned = self.masks
        logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
        return logits


class BadWordsLogitsProcessor(LogitsProcessor):
    """``SamplingParams.bad_words``: a bad word's last token is banned where its other tokens were just
    generated (vLLM's semantics; the words are tokenized at admission, ``bad_words_token_ids``)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.words: dict[int, tuple[list[list[int]], list[int]]] = {}  # index -> (token ids of each, outputs)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.words, batch_update,
                             lambda params, _, out: (params._bad_words_token_ids, out) if params.bad_words else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        banned = [(index, ids[-1]) for index, (words, out) in self.words.items() for ids in words
                  if len(ids) <= len(out) + 1 and out[len(out) - len(ids) + 1:] == ids[:-1]]
        if banned:
            logits[tuple(zip(*banned))] = float("-inf")
        return logits


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenization of bad words: each as it would start the text and, where that gives other tokens of
    the same length, after a space (inside the text)."""
    token_ids = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        token_ids += [plain, spaced] if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else [plain]
    return token_ids


BUILTIN_LOGITS_PROCESSORS = (AllowedTokenIdsLogitsProcessor, BadWordsLogitsProcessor)


def load_logits_processors(entries) -> list[type[LogitsProcessor]]:
    """``logits_processors``' classes: each entry a ``LogitsProcessor`` subclass or its "module.Class" (or
    "module:Class") name."""
    if entries is None:
        return []
    if not isinstance(entries, (list, tuple, str)):
        raise TypeError(f"logits_processors must be a list of LogitsProcessor classes or 'module.Class' names, "
                        f"got {entries!r:.80}")
    return [_load(entry) for entry in ([entries] if isinstance(entries, str) else entries)]


def _load(entry) -> type[LogitsProcessor]:
    cls = entry
    if isinstance(entry, str):
        module, _, name = entry.rpartition(":" if ":" in entry else ".")
        try:
            cls = importlib.import_module(module)
            for attr in name.split("."):
                cls = getattr(cls, attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"logits_processors entry {entry!r} cannot be imported: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise TypeError(f"logits_processors entry {entry!r:.80} is not a subclass of "
                        "nanovllm.logits_processor.LogitsProcessor")
    if inspect.isabstract(cls):
        raise TypeError(f"logits_processors entry {entry!r:.80} does not implement "
                        f"{', '.join(sorted(cls.__abstractmethods__))}")
    return cls
