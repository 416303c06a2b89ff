"""The sampler's optional stages, each run only when a request in the batch asks for it:
penalties, top-k/top-p, min-p (and ``prepare_stages``: their tensors, the min_tokens ban, seeds)."""
from __future__ import annotations

import torch


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, T] ids padded with vocab_size -> [B, V] occurrence counts."""
    counts = torch.zeros(ids.size(0), vocab_size + 1, dtype=torch.float32, device=ids.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, b) -> torch.Tensor:
    vocab_size = logits.size(1)
    counts = token_counts(b.output_ids, vocab_size)
    logits = (logits - b.frequency_penalty[:, None] * counts
              - b.presence_penalty[:, None] * (counts > 0))
    seen = (counts > 0) | (token_counts(b.prompt_ids, vocab_size) > 0)
    rep = b.repetition_penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps each row's k most likely tokens and its smallest set with probability >= p (at least
    one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        keep &= torch.arange(logits.size(1), device=logits.device)[None, :] < top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    return torch.empty_like(logits).scatter_(1, order,
                                             sorted_logits.masked_fill(~keep, float("-inf")))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values,
                              float("-inf"))


def prepare_stages(preparer, batch, seqs: list, params: list, kept_rows: list[int]) -> None:
    """The tensors of the stages some request of ``batch`` asks for (``SamplingPreparer``'s)."""

    def floats(name: str) -> torch.Tensor:
        return preparer.to_device([getattr(sp, name) for sp in params], torch.float32)

    if any(sp.needs_top_k_top_p for sp in params):
        top_k = [sp.top_k if sp.top_k > 0 else preparer.vocab_size for sp in params]
        batch.top_k, batch.top_p = preparer.to_device(top_k, torch.int64), floats("top_p")
    if any(sp.min_p > 0 for sp in params):
        batch.min_p = floats("min_p")
    if any(sp.needs_penalties for sp in params):
        batch.presence_penalty, batch.frequency_penalty, batch.repetition_penalty = map(
            floats, ("presence_penalty", "frequency_penalty", "repetition_penalty"))
        batch.output_ids = _padded(preparer, [seq.completion_token_ids for seq in seqs])
        batch.prompt_ids = _padded(preparer, [seq.token_ids[:seq.num_prompt_tokens]
                                              if sp.repetition_penalty != 1 else []
                                              for seq, sp in zip(seqs, params)])
    kept = set(kept_rows)  # only kept rows use min_tokens and seeds
    banned = [preparer.eos_token_ids | set(sp.stop_token_ids)
              if row in kept and seq.num_completion_tokens < sp.min_tokens else set()
              for row, (seq, sp) in enumerate(zip(seqs, params))]
    if any(banned):
        ids = sorted(set().union(*banned))
        batch.banned_ids = preparer.to_device(ids, torch.int64)
        batch.banned_rows = preparer.to_device([[i in r for i in ids] for r in banned], torch.bool)
    if any(sp.seed is not None for sp in params):
        for row, (seq, sp) in enumerate(zip(seqs, params)):
            if row in kept and sp.seed is not None and seq.seq_id not in preparer.generators:
                generator = torch.Generator(preparer.device).manual_seed(sp.seed)
                preparer.generators[seq.seq_id] = generator
        batch.generators = [preparer.generators.get(seq.seq_id) if row in kept else None
                            for row, seq in enumerate(seqs)]
    batch.num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)


def _padded(preparer, rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return preparer.to_device([r + [preparer.vocab_size] * (width - len(r)) for r in rows],
                              torch.int64)
