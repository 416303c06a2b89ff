"""Rotary scalings of the frequencies: linear, llama3 and YaRN (with its attention factor), as
transformers computes them."""
from __future__ import annotations

import math

import torch


def scaled(inv_freq: torch.Tensor, head_dim: int, base: float, scaling: dict
           ) -> tuple[torch.Tensor, float]:
    """(the frequencies, the attention factor) of ``scaling``'s ``rope_type``."""
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return llama3(inv_freq, scaling), 1.0
    return yarn(inv_freq, head_dim, base, scaling)


def llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Long wavelengths divided by ``factor``, short ones kept, a blend between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > old_len / low, inv_freq / factor,
                       torch.where(wavelen < old_len / high, inv_freq, blended))


def yarn(inv_freq: torch.Tensor, head_dim: int, base: float,
         scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention factor, as transformers computes them."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

    # the dimension that turns ``rotations`` times over old_len
    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float) - low)
            / (high - low if high != low else 0.001)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return inv_freq, float(attention_factor)
