"""Paged attention in plain PyTorch: the CPU path, the CUDA fallback, and the test oracle.

Caches are one layer's views ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token at
logical position p of a sequence lives at slot ``block_table[p // block_size] * block_size +
p % block_size``. Everything here is capturable in a CUDA Graph except prefill, which runs eagerly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Writes k, v [N, num_kv_heads, head_dim] at slot_mapping [N]; slot -1 is skipped.

    Without data-dependent shapes: a skipped row writes row 0's value to row 0's slot, so
    every duplicate write of a slot carries the same value (when every slot is -1, as in the warmup
    forward, row 0's value goes to slot 0 of its throwaway cache)."""
    valid = slot_mapping >= 0
    slots = torch.where(valid, slot_mapping, slot_mapping[:1]).clamp(min=0).long()
    keep = valid.view(-1, 1, 1)
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, torch.where(keep, k, k[:1]).to(k_cache.dtype))
    v_flat.index_copy_(0, slots, torch.where(keep, v, v[:1]).to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.size(1)
    positions = torch.arange(length, device=cache.device)
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    return cache.view(-1, *cache.shape[2:])[slots]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q [len_q, H, D]; k, v [len_k, KVH, D]; the queries are the last len_q of the len_k positions
    len_q, len_k = q.size(0), k.size(0)
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(diagonal=len_k - len_q)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, block_tables: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Causal attention for packed variable-length queries q [N, H, D] (k, v: the same N new
    tokens). With ``block_tables`` the keys are read from the cache (cached prefix + new).
    (``max_seqlen_q`` is unused here: the reference loops over the sequences on the host.)"""
    out = torch.empty_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q0, q1, len_k = cu_q[i], cu_q[i + 1], cu_k[i + 1] - cu_k[i]
        if block_tables is None:
            k_i, v_i = k[q0:q1], v[q0:q1]
        else:
            k_i, v_i = gather_kv(k_cache, block_tables[i], len_k), gather_kv(v_cache, block_tables[i], len_k)
        out[q0:q1] = _attend(q[q0:q1], k_i, v_i, scale)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence, q [B, H, D], over its first context_lens[b] cached tokens."""
    batch, max_blocks = block_tables.shape
    block_size = k_cache.size(1)
    tables = block_tables.clamp(min=0).long()
    k = k_cache[tables].view(batch, max_blocks * block_size, *k_cache.shape[2:])   # [B, T, KVH, D]
    v = v_cache[tables].view(batch, max_blocks * block_size, *v_cache.shape[2:])
    positions = torch.arange(max_blocks * block_size, device=q.device)
    # position 0 is always visible so that padded rows (context_len 0) give finite values
    mask = (positions < context_lens.unsqueeze(1)) | (positions == 0)                # [B, T]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out.squeeze(2)
