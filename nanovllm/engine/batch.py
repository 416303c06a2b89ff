"""A forward's input as plain arrays (``StepInput``), built on rank 0 from the scheduled sequences
and sent as it is to every rank. Position ``p``'s K/V slot is
``block_table[p // block_size] * block_size + p % block_size``."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nanovllm.engine.sequence import Sequence
from nanovllm.kernels.cascade_reference import PrefixGroups, cascade_groups


@dataclass
class StepInput:
    is_prefill: bool
    input_ids: np.ndarray  # [N] int64; decode: -1 where the token is still on the device
    positions: np.ndarray  # [N] int64
    slot_mapping: np.ndarray  # [N] int32, -1 = do not store
    block_tables: np.ndarray | None = None  # [B, W] int32, -1 padded; prefill: when keys are cached
    cu_seqlens_q: np.ndarray | None = None  # [B + 1] int32, prefill
    cu_seqlens_k: np.ndarray | None = None  # [B + 1] int32, prefill
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    context_lens: np.ndarray | None = None  # [B] int32, decode
    logits_indices: np.ndarray | None = None  # [R] int64, prefill: the rows the LM head projects
    prev_rows: np.ndarray | None = None  # [B] int64, decode: row of the last samples; -1: known
    prefix_groups: PrefixGroups | None = None  # decode: rows sharing leading blocks (cascade)

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_q) - 1 if self.is_prefill else len(self.context_lens)


def slots(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """[end - start] int32: the slots of positions [start, end); -1 (store nothing) without a
    block table."""
    if not block_table:
        return np.full(end - start, -1, dtype=np.int32)
    positions = np.arange(start, end)
    table = np.asarray(block_table, dtype=np.int64)
    return (table[positions // block_size] * block_size + positions % block_size).astype(np.int32)


def block_tables(seqs: list[Sequence]) -> np.ndarray:
    """[len(seqs), longest table] int32, -1 padded."""
    table = np.full((len(seqs), max(len(seq.block_table) for seq in seqs)), -1, dtype=np.int32)
    for row, seq in zip(table, seqs):
        row[:len(seq.block_table)] = seq.block_table
    return table


def prefill_rows(seqs: list[Sequence], starts: list[int], counts: list[int], block_size: int,
                 shift: int = 0) -> StepInput:
    """``counts[i]`` positions of sequence i from ``starts[i]``, p reading token p + ``shift``."""
    ends = [s + n for s, n in zip(starts, counts)]
    cu_q, cu_k = np.cumsum([0, *counts], dtype=np.int32), np.cumsum([0, *ends], dtype=np.int32)
    spans = list(zip(seqs, starts, ends))
    return StepInput(
        is_prefill=True,
        input_ids=np.array([t for seq, s, e in spans for t in seq.token_ids[s + shift:e + shift]],
                           dtype=np.int64),
        positions=np.concatenate([np.arange(s, e) for _, s, e in spans]).astype(np.int64),
        slot_mapping=np.concatenate([slots(seq.block_table, s, e, block_size)
                                     for seq, s, e in spans]),
        block_tables=block_tables(seqs) if cu_k[-1] > cu_q[-1] else None,  # keys are cached
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(counts), max_seqlen_k=max(ends),
        logits_indices=(cu_q[1:] - 1).astype(np.int64))  # each sequence's last row


def prepare_prefill(seqs: list[Sequence], block_size: int) -> StepInput:
    """Scheduled tokens; the LM head projects each last row, or a prompt-logprobs chunk's all."""
    step = prefill_rows(seqs, [seq.num_cached_tokens for seq in seqs],
                        [seq.num_scheduled_tokens for seq in seqs], block_size)
    if any(seq.num_prompt_logprob_rows for seq in seqs):
        cu_q = step.cu_seqlens_q
        step.logits_indices = np.concatenate([
            np.arange(cu_q[i], cu_q[i + 1]) if seq.num_prompt_logprob_rows else [cu_q[i + 1] - 1]
            for i, seq in enumerate(seqs)]).astype(np.int64)
    return step


def prepare_decode(seqs: list[Sequence], block_size: int, inflight=None,
                   cascade: bool = False) -> StepInput:
    """Each sequence's last token; one still on the device (async scheduling) comes from its row
    of the in-flight batch's samples (``prev_rows``); ``cascade``: ``prefix_groups``."""
    context_lens = np.array([seq.num_tokens for seq in seqs], dtype=np.int32)
    step = StepInput(
        is_prefill=False,
        input_ids=np.array([-1 if seq.num_pending_tokens else seq.token_ids[-1] for seq in seqs],
                           dtype=np.int64),
        positions=(context_lens - 1).astype(np.int64),
        slot_mapping=np.array([seq.block_table[-1] * block_size + (n - 1) % block_size
                               for seq, n in zip(seqs, context_lens.tolist())], dtype=np.int32),
        block_tables=block_tables(seqs), context_lens=context_lens)
    if cascade and (step.block_tables[1:, 0] == step.block_tables[:-1, 0]).any():
        step.prefix_groups = cascade_groups(step.block_tables, context_lens, block_size)
    if any(seq.num_pending_tokens for seq in seqs):
        row_of = {inflight.seqs[row].seq_id: row for row in inflight.kept_rows}
        step.prev_rows = np.array([row_of[seq.seq_id] if seq.num_pending_tokens else -1
                                   for seq in seqs], dtype=np.int64)
    return step
