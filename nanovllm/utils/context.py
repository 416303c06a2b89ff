"""The attention context: what attention layers need besides the activations, set per thread."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Context:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1] int32, prefill
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1] int32, prefill
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None  # [num_new_tokens] int32, -1 = do not store
    logits_indices: torch.Tensor | None = None  # [num_logits] int64, prefill: the LM head's rows
    context_lens: torch.Tensor | None = None  # [num_seqs] int32, decode
    block_tables: torch.Tensor | None = None  # [num_seqs, max_num_blocks] int32, -1 = padding
    prefixes: tuple | None = None  # decode: shared blocks read once (a SharedPrefixes)


_EMPTY, _STATE = Context(), threading.local()


def get_context() -> Context:
    return getattr(_STATE, "context", _EMPTY)


@contextmanager
def set_context(is_prefill: bool, **fields):
    previous, _STATE.context = get_context(), Context(is_prefill, **fields)
    try:  # nested (a decode graph captured during a step): the outer context comes back
        yield _STATE.context
    finally:
        _STATE.context = previous
