"""Rotary position embedding (the rotate-half layout of Hugging Face's Llama/Qwen), with the
``linear`` and Llama 3.1 (``llama3``) frequency scalings."""
from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE = ("default", "linear", "llama3")


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":  # long wavelengths divided by ``factor``, short ones kept, a smooth blend between
            factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
            old_len = scaling["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
            blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
            inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                                   torch.where(wavelen < old_len / high, inv_freq, blended))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        # [max_position, head_dim]: cos then sin, each for half of the head
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions [N]; q [N, num_heads, head_dim]; k [N, num_kv_heads, head_dim]
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)


def get_rope(head_dim: int, max_position: int, hf_config) -> RotaryEmbedding:
    """The table for positions 0 to ``max_position - 1`` from a transformers config (``rope_parameters``
    in transformers 5, ``rope_theta``/``rope_scaling`` before); one module serves every layer."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    if params["rope_type"] not in SUPPORTED_ROPE:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE}")
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return RotaryEmbedding(head_dim, max_position, base, params)
