"""One forward's input as a plain record of arrays (``StepInput``), built on rank 0 by pure functions
of the scheduled sequences and sent as it is to every rank.

For logical position ``p`` of a sequence, its K/V slot is ``block_table[p // block_size] * block_size +
p % block_size``; a sequence without blocks (the warmup's) gets slots of -1, which no kernel stores.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nanovllm.engine.sequence import Sequence


@dataclass
class StepInput:
    is_prefill: bool
    input_ids: np.ndarray                    # [N] int64; decode: -1 where the token is still on the device
    positions: np.ndarray                    # [N] int64
    slot_mapping: np.ndarray                 # [N] int32, -1 = do not store
    block_tables: np.ndarray | None = None   # [B, W] int32, -1 padded; prefill: only when keys are cached
    cu_seqlens_q: np.ndarray | None = None   # [B + 1] int32, prefill
    cu_seqlens_k: np.ndarray | None = None   # [B + 1] int32, prefill
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    context_lens: np.ndarray | None = None   # [B] int32, decode
    # prefill: the rows the LM head projects: each sequence's last, every one of a sequence that
    # computes prompt logprobs
    logits_indices: np.ndarray | None = None  # [R] int64
    prev_rows: np.ndarray | None = None      # decode: [B] int64 row of the previous step's samples, -1 = known

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_q) - 1 if self.is_prefill else len(self.context_lens)


def slots(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """[end - start] int32: the slots of positions [start, end) (-1 without a block table)."""
    positions = np.arange(start, end)
    if not block_table:
        return np.full(end - start, -1, dtype=np.int32)
    table = np.asarray(block_table, dtype=np.int64)
    return (table[positions // block_size] * block_size + positions % block_size).astype(np.int32)


def block_tables(seqs: list[Sequence]) -> np.ndarray:
    """[len(seqs), longest table] int32, -1 past each table's end."""
    table = np.full((len(seqs), max(len(seq.block_table) for seq in seqs)), -1, dtype=np.int32)
    for row, seq in zip(table, seqs):
        row[:len(seq.block_table)] = seq.block_table
    return table


def prepare_prefill(seqs: list[Sequence], block_size: int) -> StepInput:
    """Each sequence's scheduled tokens [num_cached_tokens, + num_scheduled_tokens). The LM head
    projects each sequence's last position, and every position of a sequence whose chunk gives prompt
    logprobs (``logits_indices``)."""
    starts = [seq.num_cached_tokens for seq in seqs]
    counts = [seq.num_scheduled_tokens for seq in seqs]
    cu_q = np.cumsum([0, *counts], dtype=np.int32)
    cu_k = np.cumsum([0, *(s + n for s, n in zip(starts, counts))], dtype=np.int32)
    step = StepInput(
        is_prefill=True,
        input_ids=np.array([t for seq in seqs for t in seq.scheduled_token_ids], dtype=np.int64),
        positions=np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)]).astype(np.int64),
        slot_mapping=np.concatenate([slots(seq.block_table, s, s + n, block_size)
                                     for seq, s, n in zip(seqs, starts, counts)]),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(counts),
        max_seqlen_k=max(s + n for s, n in zip(starts, counts)))
    if cu_k[-1] > cu_q[-1]:  # part of the keys come from the cache
        step.block_tables = block_tables(seqs)
    step.logits_indices = np.concatenate([
        np.arange(cu_q[i], cu_q[i + 1]) if seq.num_prompt_logprob_rows else [cu_q[i + 1] - 1]
        for i, seq in enumerate(seqs)]).astype(np.int64)
    return step


def prepare_decode(seqs: list[Sequence], block_size: int, inflight=None) -> StepInput:
    """One token per sequence: its last (position len - 1, in its last block). A token still on the device
    (async scheduling) is taken from its row of the in-flight batch's samples (``prev_rows``)."""
    context_lens = np.array([seq.num_tokens for seq in seqs], dtype=np.int32)
    step = StepInput(
        is_prefill=False,
        input_ids=np.array([-1 if seq.num_pending_tokens else seq.token_ids[-1] for seq in seqs], dtype=np.int64),
        positions=(context_lens - 1).astype(np.int64),
        slot_mapping=np.array([seq.block_table[-1] * block_size + (n - 1) % block_size
                               for seq, n in zip(seqs, context_lens.tolist())], dtype=np.int32),
        block_tables=block_tables(seqs), context_lens=context_lens)
    if any(seq.num_pending_tokens for seq in seqs):
        row_of = {inflight.seqs[row].seq_id: row for row in inflight.kept_rows}
        step.prev_rows = np.array([row_of[seq.seq_id] if seq.num_pending_tokens else -1 for seq in seqs],
                                  dtype=np.int64)
    return step
