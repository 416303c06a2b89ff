"""Rotary position embedding (Hugging Face's rotate-half layout) with the linear, llama3 and yarn scalings."""
from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


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
        elif rope_type == "llama3":  # long wavelengths divided by ``factor``, short ones kept, a blend between
            factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
            old_len = scaling["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
            blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
            inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                                   torch.where(wavelen < old_len / high, inv_freq, blended))
        attention_factor = 1.0
        if rope_type == "yarn":
            inv_freq, attention_factor = yarn(inv_freq, head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        # [max_position, head_dim]: cos, then sin
        self.register_buffer("cos_sin_cache", attention_factor * torch.cat((freqs.cos(), freqs.sin()), dim=-1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions [N]; q [N, num_heads, head_dim]; k [N, num_kv_heads, head_dim]
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)


def yarn(inv_freq: torch.Tensor, head_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention factor, as transformers computes them."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return inv_freq, float(attention_factor)


def get_rope(head_dim: int, max_position: int, hf_config) -> RotaryEmbedding:
    """The table for positions below ``max_position``, from ``rope_parameters`` or ``rope_theta``/``rope_scaling``."""
    params = rope_parameters(hf_config)
    if params["rope_type"] == "yarn" and params.get("factor") is None:  # transformers': the ratio of the lengths
        params["factor"] = hf_config.max_position_embeddings / params["original_max_position_embeddings"]
    return RotaryEmbedding(head_dim, max_position, params["rope_theta"], params)


# rope_type -> the fields it needs (yarn's factor defaults to the ratio of the lengths)
_REQUIRED = {"default": (), "linear": ("factor",), "yarn": ("original_max_position_embeddings",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
_POSITIVE = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
             "attention_factor", "original_max_position_embeddings")


def rope_parameters(config) -> dict:
    """A config's (or config.json dict's) rotary fields, ``rope_type`` and ``rope_theta`` filled in; refuses by
    name a field that is missing or not a positive number (the table would be NaN)."""
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    key = "rope_parameters" if get("rope_parameters") else "rope_scaling"
    params = dict(get(key) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE}")
    names = {name: f"{key}[{name!r}]" for name in _POSITIVE}
    if params.get("rope_theta") is None:
        theta = get("rope_theta")
        params["rope_theta"], names["rope_theta"] = 10000.0 if theta is None else theta, "rope_theta"
    for name in _REQUIRED[rope_type]:
        if params.get(name) is None:
            raise ValueError(f"the model's {names[name]} is missing: rope_type {rope_type!r} needs it")
    for name in _POSITIVE:
        value = params.get(name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and 0 < value < math.inf):
            raise ValueError(f"the model's {names[name]} must be a finite number > 0, got {value!r}")
    if rope_type == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ValueError(f"the model's {names['high_freq_factor']} must be greater than its low_freq_factor, got "
                         f"{params['high_freq_factor']!r} and {params['low_freq_factor']!r}")
    return params
