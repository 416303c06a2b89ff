"""The attention layer: stores new K/V into the paged cache at ``slot_mapping``, then runs the
prefill or decode kernel of the backend the model runner chose at start-up."""
from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from nanovllm.kernels import reference
from nanovllm.utils.context import Context, get_context

logger = logging.getLogger(__name__)


class TorchBackend:
    """Plain PyTorch paged attention: any device, dtype, block size and head_dim."""

    name = "torch"
    store_kvcache = staticmethod(reference.store_kvcache)

    @staticmethod
    def prefill(q, k, v, k_cache, v_cache, ctx: Context, scale: float):
        return reference.prefill_attention(q, k, v, k_cache, v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                           ctx.block_tables, scale)

    @staticmethod
    def decode(q, k_cache, v_cache, ctx: Context, scale: float):
        return reference.decode_attention(q, k_cache, v_cache, ctx.context_lens, ctx.block_tables, scale)


class FlashAttnBackend:
    """flash-attn 2: varlen prefill (paged when part of the keys are cached) and paged decode."""

    name = "flash-attn"
    store_kvcache = staticmethod(reference.store_kvcache)

    @staticmethod
    def prefill(q, k, v, k_cache, v_cache, ctx: Context, scale: float):
        from flash_attn import flash_attn_varlen_func
        if ctx.block_tables is not None:
            k, v = k_cache, v_cache
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=ctx.cu_seqlens_q, cu_seqlens_k=ctx.cu_seqlens_k,
                                      max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                                      softmax_scale=scale, causal=True, block_table=ctx.block_tables)

    @staticmethod
    def decode(q, k_cache, v_cache, ctx: Context, scale: float):
        from flash_attn import flash_attn_with_kvcache
        out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.context_lens,
                                      block_table=ctx.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)


def select_backend(device: str, dtype: torch.dtype, block_size: int, head_dim: int):
    """flash-attn where it is installed and supports the shapes, else the PyTorch reference."""
    reasons = []
    if device != "cuda":
        reasons.append(f"device is {device}")
    if importlib.util.find_spec("flash_attn") is None:
        reasons.append("flash_attn is not installed")
    if dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"dtype {dtype} (flash-attn: bf16, fp16)")
    if block_size % 256:
        reasons.append(f"kvcache_block_size {block_size} (flash-attn paged KV: multiples of 256)")
    if head_dim % 8 or head_dim > 256:
        reasons.append(f"head_dim {head_dim}")
    backend = TorchBackend if reasons else FlashAttnBackend
    logger.info("attention backend: %s (%s)", backend.name, "; ".join(reasons) or "supported")
    return backend


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        # Set by the model runner: views of its KV-cache tensor, and the backend.
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = TorchBackend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [N, num_heads, head_dim]; k, v [N, num_kv_heads, head_dim] -> [N, num_heads, head_dim]
        ctx = get_context()
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache.numel():  # no cache during the warmup forward that sizes it
            self.backend.store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            return self.backend.prefill(q, k, v, k_cache, v_cache, ctx, self.scale)
        return self.backend.decode(q, k_cache, v_cache, ctx, self.scale)
