"""Rotary position embedding (the rotate-half layout of Hugging Face's Llama/Qwen)."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.utils.compile import compile_on_cuda


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        # [max_position, head_dim]: cos then sin, each for half of the head
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    @compile_on_cuda
    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions [N]; q [N, num_heads, head_dim]; k [N, num_kv_heads, head_dim]
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)


def get_rope(head_dim: int, max_position: int, hf_config) -> RotaryEmbedding:
    """Builds the rotary embedding from a transformers config (``rope_parameters`` in
    transformers 5, ``rope_theta``/``rope_scaling`` before)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf_config, "rope_scaling", None)
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
        raise ValueError(f"rope scaling {params or scaling!r} is not supported yet (only the default rope)")
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return RotaryEmbedding(head_dim, max_position, base)
