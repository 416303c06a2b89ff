"""Rotary position embedding (Hugging Face's rotate-half layout) and a config's rotary fields."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers import rope_scaling

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")
# rope_type -> the fields it needs (yarn's factor defaults to the ratio of the lengths)
_REQUIRED = {"default": (), "linear": ("factor",), "yarn": ("original_max_position_embeddings",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings")}
_POSITIVE = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast",
             "beta_slow", "attention_factor", "original_max_position_embeddings")


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        attention_factor = 1.0
        if (scaling or {}).get("rope_type", "default") != "default":  # rope_scaling's
            inv_freq, attention_factor = rope_scaling.scaled(inv_freq, head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cache = attention_factor * torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [max_position, head_dim]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions [N]; q [N, num_heads, head_dim]; k [N, num_kv_heads, head_dim]
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)


def get_rope(head_dim: int, max_position: int, hf_config) -> RotaryEmbedding:
    params = rope_parameters(hf_config)
    if params["rope_type"] == "yarn" and params.get("factor") is None:
        params["factor"] = (hf_config.max_position_embeddings
                            / params["original_max_position_embeddings"])
    return RotaryEmbedding(head_dim, max_position, params["rope_theta"], params)


def rope_parameters(config) -> dict:
    """A config's (or config.json dict's) rotary fields with defaults; refuses bad ones by name."""
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    key = "rope_parameters" if get("rope_parameters") else "rope_scaling"
    params = dict(get(key) or {})
    rope_type = params.setdefault("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE}")
    names = {n: f"{key}[{n!r}]" for n in _POSITIVE}
    if params.get("rope_theta") is None:
        theta, names["rope_theta"] = get("rope_theta"), "rope_theta"
        params["rope_theta"] = 10000.0 if theta is None else theta
    for n in _REQUIRED[rope_type]:
        if params.get(n) is None:
            raise ValueError(f"the model's {names[n]} is missing: rope_type {rope_type!r} needs it")
    for n in _POSITIVE:  # not a finite positive number: the table would be NaN
        value = params.get(n)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and 0 < value < float("inf")):
            raise ValueError(f"the model's {names[n]} must be a finite number > 0, got {value!r}")
    high, low = params.get("high_freq_factor"), params.get("low_freq_factor")
    if rope_type == "llama3" and not high > low:
        raise ValueError(f"the model's {names['high_freq_factor']} must be greater than its "
                         f"low_freq_factor, got {high!r} and {low!r}")
    return params
