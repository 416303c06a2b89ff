"""Logprobs: of the sampled tokens (a request's ``logprobs``) and of its prompt
(``prompt_logprobs``): which logits rows give them, their top-k, and vLLM's entries
(``{token: Logprob}``, the chosen token first)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import logprobs_of
from nanovllm.logprobs import FlatLogprobs, Logprob


@dataclass
class PromptLogprobsBatch:
    """A prefill's prompt logprobs: the LM head projects every scheduled position of a sequence that
    computes them and the last position of the others, in batch order."""

    # [num_seqs] the logits row of each sequence's last scheduled position
    sample_rows: torch.Tensor
    rows: torch.Tensor  # [R] the logits rows whose next token is a prompt token
    target_ids: torch.Tensor  # [R] those prompt tokens
    targets: list[int]  # the same, on the host
    # per sequence: (first prompt position, count, k), or None
    spans: list[tuple[int, int, int] | None]
    num_top: int  # the largest k


def prepare_prompt_logprobs(preparer, seqs: list[Sequence]) -> PromptLogprobsBatch | None:
    """Which logits rows give which prompt logprobs (position p's are token p + 1's), or None if
    none do."""
    counts = [seq.num_prompt_logprob_rows for seq in seqs]
    if not any(counts):
        return None
    sample_rows, rows, targets, spans = [], [], [], []
    row = 0
    for seq, count in zip(seqs, counts):
        if count:
            start = seq.num_cached_tokens
            rows.extend(range(row, row + count))
            targets.extend(seq.token_ids[start + 1:start + 1 + count])
            spans.append((start + 1, count, seq.sampling_params.prompt_logprobs))
            row += seq.num_scheduled_tokens
        else:
            spans.append(None)
            row += 1
        sample_rows.append(row - 1)
    return PromptLogprobsBatch(preparer.to_device(sample_rows, torch.int64),
                               preparer.to_device(rows, torch.int64),
                               preparer.to_device(targets, torch.int64), targets, spans,
                               max(span[2] for span in spans if span is not None))


def prompt_logprobs(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, num_top: int,
                    slice_rows: int = 1024) -> tuple[torch.Tensor, ...]:
    """``logprobs_of`` the next prompt tokens ``targets`` [R] at logits ``rows`` [R], ``slice_rows``
    rows at a time to bound the float32 copy."""
    parts = [logprobs_of(torch.log_softmax(logits[rows[start:start + slice_rows]].float(), dim=-1),
                         targets[start:start + slice_rows], num_top)
             for start in range(0, rows.numel(), slice_rows)]
    return tuple(torch.cat(p) for p in zip(*parts))


def _logprob_entry(top_ids: list[int], top_values: list[float], k: int, token: int, logprob: float,
                   rank: int) -> dict[int, Logprob]:
    """vLLM's logprobs entry: the chosen (or actual) token first (its top-k rank if a tie), then the
    top k."""
    top = list(zip(top_ids[:k], top_values[:k]))
    entry = {token: Logprob(logprob,
                            next((r for r, (t, _) in enumerate(top, 1) if t == token), rank))}
    for r, (t, v) in enumerate(top, 1):
        entry.setdefault(t, Logprob(v, r))
    return entry


def logprob_entries(tensors, num_logprobs: list[int | None], token_ids: list[int]) -> list:
    """Per sequence, the entry of its sampled token (None where it asked for no logprobs)."""
    sampled, ranks, top_ids, top_values = (t.tolist() for t in tensors)
    return [None if k is None else
            _logprob_entry(top_ids[i], top_values[i], k, token, sampled[i], ranks[i])
            for i, (k, token) in enumerate(zip(num_logprobs, token_ids))]


def prompt_logprob_entries(prompt: PromptLogprobsBatch, tensors) -> list:
    """Per sequence, (first prompt position, entries) or None."""
    target, ranks, top_ids, top_values = (t.tolist() for t in tensors)
    out, row = [None] * len(prompt.spans), 0
    for i, span in enumerate(prompt.spans):
        if span is not None:
            first, count, k = span
            out[i] = (first, [_logprob_entry(top_ids[r], top_values[r], k, prompt.targets[r],
                                             target[r], ranks[r]) for r in range(row, row + count)])
            row += count
    return out


def entries_out(entries: list, tokenizer, sp):
    """A copy of logprob ``entries`` (the sequence's list grows), with each ``decoded_token``
    ("" for an id past the tokenizer's vocabulary) unless ``detokenize=False``, flat with
    ``flat_logprobs``."""
    entries = list(entries)
    if tokenizer is not None and sp.detokenize:
        for token, lp in (item for entry in entries for item in (entry or {}).items()):
            if lp.decoded_token is None:
                piece = tokenizer.convert_ids_to_tokens(token)
                lp.decoded_token = ("" if piece is None
                                    else tokenizer.convert_tokens_to_string([piece]))
    return FlatLogprobs.of(entries) if sp.flat_logprobs else entries


