"""Paged attention and dense ops in plain PyTorch (the CPU path, CUDA fallback and test oracle). A
cache is one layer's [num_blocks, block_size, num_kv_heads, head_dim], position p at slot
block_table[p // block_size] * block_size + p % block_size; fp8 holds K/V / the layer's scales."""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # the largest float8_e4m3fn


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes k, v [N, num_kv_heads, head_dim] at slot_mapping [N], skipping slot -1 without
    data-dependent shapes (CUDA graphs): a skipped row rewrites the first valid row, identically."""
    valid = slot_mapping >= 0
    first = valid.int().argmax().view(1)  # 0 when no row is valid; a tensor index: no host sync
    slots = torch.where(valid, slot_mapping, slot_mapping.index_select(0, first)).clamp(0).long()
    keep = valid.view(-1, 1, 1)
    for x, cache, kv_scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = to_cache_dtype(torch.where(keep, x, x.index_select(0, first)), cache.dtype, kv_scale)
        _bytes(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, _bytes(rows))


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, kv_scale: float = 1.0) -> torch.Tensor:
    """fp8 (e4m3) holds x / kv_scale, saturated at +-448 instead of overflowing to NaN."""
    if dtype == torch.float8_e4m3fn:
        x = (x.float() / kv_scale).clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def _bytes(x: torch.Tensor) -> torch.Tensor:  # fp8 as uint8: CPU indexing ops lack fp8 kernels
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def gather_blocks(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype,
                  kv_scale: float) -> torch.Tensor:
    if cache.dtype != torch.float8_e4m3fn:
        return cache[index].to(dtype)
    return (_bytes(cache)[index].view(cache.dtype).float() * kv_scale).to(dtype)


def _window_mask(mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 window: int) -> torch.Tensor:
    """``mask`` [..., Q, K] also hiding the keys at or before q_pos - window (none for window 0)."""
    return mask & (k_pos > q_pos.unsqueeze(-1) - window) if window else mask


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, block_tables: torch.Tensor | None, scale: float,
                      k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0) -> torch.Tensor:
    """Causal attention of packed varlen q [N, H, D] (k, v: the N new tokens); with ``block_tables``
    every key (cached prefix and new) comes from the cache. A host loop: not graph-capturable."""
    out = torch.empty_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q0, q1, len_k = cu_q[i], cu_q[i + 1], cu_k[i + 1] - cu_k[i]
        pos = torch.arange(len_k, device=q.device)
        if block_tables is None:
            k_i, v_i = k[q0:q1], v[q0:q1]
        else:
            block_size = k_cache.size(1)
            slots = block_tables[i][pos // block_size].long() * block_size + pos % block_size
            k_i, v_i = (gather_blocks(c.view(-1, *c.shape[2:]), slots, q.dtype, s)
                        for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
        past = len_k - (q1 - q0)  # the queries are the last q1 - q0 of the len_k positions
        mask = torch.ones(q1 - q0, len_k, dtype=torch.bool, device=q.device).tril(diagonal=past)
        mask = _window_mask(mask, pos[past:], pos, window)
        out[q0:q1] = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k_i.transpose(0, 1), v_i.transpose(0, 1), attn_mask=mask,
            scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0) -> torch.Tensor:
    """One query per sequence, q [B, H, D], over its context_lens[b] cached tokens (last window)."""
    tables = block_tables.clamp(min=0).long()
    k, v = (gather_blocks(c, tables, q.dtype, s).flatten(1, 2)  # [B, T, KVH, D]
            for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
    positions = torch.arange(k.size(1), device=q.device)
    mask = _window_mask(positions < context_lens.unsqueeze(1), context_lens - 1, positions, window)
    # position 0 stays visible so that padded rows (context_len 0) give finite values
    mask |= (positions == 0) & (context_lens.unsqueeze(1) == 0)  # [B, T]
    return F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
        scale=scale, enable_gqa=True).squeeze(2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    f = x.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for x [M, 2 * I] = [gate | up] -> [M, I]."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x @ weight.T + bias; ``silu_mul``: weight [gate; up], y = SiLU(gate) * up; residual += y."""
    y = F.linear(x, weight, bias)
    y = silu_and_mul(y) if silu_mul else y
    return y if residual is None else residual.add_(y)
