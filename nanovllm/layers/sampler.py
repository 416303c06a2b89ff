"""Rank 0's batched sampling with per-request parameters (a plain CUDA batch: one Triton pass)."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanovllm.layers.sampling_stages import apply_min_p, apply_penalties, apply_top_k_top_p


@functools.cache
def _triton_sampler():  # None without triton; imported lazily, so CPU runs never load triton
    with contextlib.suppress(ImportError):
        from nanovllm.kernels import triton_sampler
        return triton_sampler


@dataclass
class SamplingBatch:
    """A batch's sampling parameters on the device: [B] float32 unless noted, None where unused."""
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
    masks: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    transforms: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)

    @property
    def is_plain(self) -> bool:
        return self.num_logprobs < 0 and not self.transforms and all(x is None for x in (
            self.top_k, self.top_p, self.min_p, self.presence_penalty, self.repetition_penalty,
            self.banned_ids, self.generators))


class Sampler(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed, self.num_draws = seed & 0x7FFFFFFF, 0

    def forward(self, logits: torch.Tensor, b: SamplingBatch,
                generator: torch.Generator | None = None):
        """(token ids [B], -1 for NaN/+inf logits; ``logprobs_of``'s tuple or None), vLLM's order"""
        for mask in b.masks:  # a grammar's: the logprobs see them
            logits = mask(logits)
        if b.is_plain and logits.is_cuda and (fast := _triton_sampler()) is not None:
            self.num_draws += 1
            seed = self.seed << 32 | self.num_draws & 0xFFFFFFFF
            return fast.sample(logits, b.temperatures, seed), None
        logits = logits.float()
        noise = torch.empty_like(logits).exponential_(1, generator=generator)
        raw = torch.log_softmax(logits, dim=-1) if b.num_logprobs >= 0 else None  # raw logprobs
        for transform in b.transforms:  # logits processors: after the logprobs
            logits = transform(logits)
        bad = (top := logits.amax(-1)).isnan() | top.isposinf()  # a NaN or +inf logit: marked -1
        if b.presence_penalty is not None:
            logits = apply_penalties(logits, b)
        if (ids := b.banned_ids) is not None:  # the min_tokens ban
            logits[:, ids] = torch.where(b.banned_rows, float("-inf"), logits[:, ids])
        scaled = logits / torch.where(b.temperatures > 0, b.temperatures, 1.0)[:, None]
        if b.top_k is not None or b.top_p is not None:
            scaled = apply_top_k_top_p(scaled, b.top_k, b.top_p)
        if b.min_p is not None:
            scaled = apply_min_p(scaled, b.min_p)
        for row, g in enumerate(b.generators or ()):  # seeded rows: their own Gumbel noise
            if g is not None:
                noise[row].exponential_(1, generator=g)
        sampled = (torch.softmax(scaled, dim=-1) / noise.clamp_min(1e-20)).argmax(dim=-1)
        token_ids = torch.where(b.temperatures > 0, sampled, logits.argmax(dim=-1))
        logprobs = None if raw is None else logprobs_of(raw, token_ids, b.num_logprobs)
        return token_ids.masked_fill(bad, -1), logprobs


def logprobs_of(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
                ) -> tuple[torch.Tensor, ...]:
    """(token_ids' logprobs [R], ranks (1 + how many more likely), top ids, top logprobs [R, K])."""
    chosen = logprobs.gather(1, token_ids[:, None])
    top = logprobs.topk(max(k, 1), dim=-1)
    return chosen.squeeze(1), (logprobs > chosen).sum(-1) + 1, top.indices, top.values
