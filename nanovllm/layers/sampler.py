"""Sampling on rank 0, vectorized over a batch in which each request has its own parameters; each optional stage
runs only when a request in the batch asks for it. On CUDA a plain batch takes one Triton pass instead."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@functools.cache
def _triton_sampler():
    """The Triton sampler module, or None without triton; imported lazily, so CPU runs never load triton."""
    try:
        from nanovllm.kernels import triton_sampler
    except ImportError:
        return None
    return triton_sampler


@dataclass
class SamplingBatch:
    """One batch's sampling parameters on the device, [B] float32 unless noted; None where no request uses a
    stage."""

    temperatures: torch.Tensor  # 0 = greedy
    top_k: torch.Tensor | None = None  # [B] int64, vocab size = off
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_ids: torch.Tensor | None = None  # [B, T] int64 generated tokens, padded with vocab size
    prompt_ids: torch.Tensor | None = None  # [B, P] int64 prompt tokens, padded with vocab size
    banned_ids: torch.Tensor | None = None  # [E] int64 EOS/stop ids some row must not emit yet
    banned_rows: torch.Tensor | None = None  # [B, E] bool: row b is under min_tokens and bans id e
    generators: list[torch.Generator | None] | None = None  # per row; None: the engine's generator
    num_logprobs: int = -1  # max top-k logprobs asked for in the batch; -1 = none
    # functions of the logits [B, V] that logits hooks add for a step: ``masks`` first (the
    # logprobs see them), ``transforms`` after the logprobs
    masks: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    transforms: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)

    @property
    def is_plain(self) -> bool:
        return self.num_logprobs < 0 and not self.transforms and all(getattr(self, f) is None for f in (
            "top_k", "top_p", "min_p", "presence_penalty", "repetition_penalty", "banned_ids", "generators"))


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, T] ids padded with vocab_size -> [B, V] occurrence counts."""
    counts = torch.zeros(ids.size(0), vocab_size + 1, dtype=torch.float32, device=ids.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    vocab_size = logits.size(1)
    counts = token_counts(b.output_ids, vocab_size)
    logits = logits - b.frequency_penalty[:, None] * counts - b.presence_penalty[:, None] * (counts > 0)
    seen = (counts > 0) | (token_counts(b.prompt_ids, vocab_size) > 0)
    rep = b.repetition_penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps each row's k most likely tokens and its smallest set with probability >= p (at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        keep &= torch.arange(logits.size(1), device=logits.device)[None, :] < top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(~keep, float("-inf")))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))


class Sampler(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = seed & 0x7FFFFFFF
        self.num_draws = 0

    def forward(self, logits: torch.Tensor, b: SamplingBatch, generator: torch.Generator | None = None):
        """(token ids [B], ``logprobs_of``'s tuple or None). vLLM's order: the masks (a grammar's), raw
        logprobs, the transforms (logits processors), penalties, the min_tokens ban, temperature, top-k/top-p/min-p, a Gumbel-max draw; seeded rows
        use their own noise."""
        for mask in b.masks:
            logits = mask(logits)
        fast = _triton_sampler() if b.is_plain and logits.is_cuda else None
        if fast is not None:
            self.num_draws += 1
            return fast.sample(logits, b.temperatures, self.seed << 32 | self.num_draws & 0xFFFFFFFF), None
        logits = logits.float()
        noise = torch.empty_like(logits).exponential_(1, generator=generator)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if b.num_logprobs >= 0 else None
        for transform in b.transforms:
            logits = transform(logits)
        if b.presence_penalty is not None:
            logits = apply_penalties(logits, b)
        if b.banned_ids is not None:
            logits[:, b.banned_ids] = torch.where(b.banned_rows, float("-inf"), logits[:, b.banned_ids])
        scaled = logits / torch.where(b.temperatures > 0, b.temperatures, 1.0)[:, None]
        if b.top_k is not None or b.top_p is not None:
            scaled = apply_top_k_top_p(scaled, b.top_k, b.top_p)
        if b.min_p is not None:
            scaled = apply_min_p(scaled, b.min_p)
        for row, g in enumerate(b.generators or ()):
            if g is not None:
                noise[row].exponential_(1, generator=g)
        sampled = (torch.softmax(scaled, dim=-1) / noise.clamp_min(1e-20)).argmax(dim=-1)
        token_ids = torch.where(b.temperatures > 0, sampled, logits.argmax(dim=-1))
        if raw_logprobs is None:
            return token_ids, None
        return token_ids, logprobs_of(raw_logprobs, token_ids, b.num_logprobs)


def logprobs_of(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(logprobs of ``token_ids`` [R] in ``logprobs`` [R, V], their ranks (1 + the number more likely), top ids
    [R, K], top logprobs [R, K]), K = max(k, 1)."""
    chosen = logprobs.gather(1, token_ids[:, None])
    top = logprobs.topk(max(k, 1), dim=-1)
    return chosen.squeeze(1), (logprobs > chosen).sum(-1) + 1, top.indices, top.values
