"""Attention and its backends (picked by ``resolve_backend``, bound by ``bind_backend``)."""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from nanovllm.kernels.cascade_reference import cascade_decode_attention
from nanovllm.layers import cuda_backends
from nanovllm.utils.context import Context, get_context

logger = logging.getLogger("nanovllm")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kvcache: Callable  # (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale); -1: skip
    prefill: Callable  # (q, k, v, layer, ctx) -> [N, num_heads, head_dim]
    decode: Callable  # (q, layer, ctx) -> [B, num_heads, head_dim]
    qk_norm_rope_store: Callable | None = None  # optional, fused: q/k RMSNorm, rotary, KV store


def _kernel_module_backend(name: str, *shape) -> AttentionBackend:  # "torch" or "triton"
    module = importlib.import_module(
        f"nanovllm.kernels.{'triton_attention' if name == 'triton' else 'reference'}")

    def prefill(q, k, v, attn: Attention, ctx: Context):
        return module.prefill_attention(q, k, v, attn.k_cache, attn.v_cache, ctx.cu_seqlens_q,
                                        ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.block_tables,
                                        attn.scale, attn.k_scale, attn.v_scale, attn.sliding_window)

    cascade = cascade_decode_attention if name == "torch" else module.decode_attention

    def decode(q, attn: Attention, ctx: Context):  # windowed layers: no cascade, their own keys
        args = (q, attn.k_cache, attn.v_cache, ctx.context_lens, ctx.block_tables, attn.scale,
                attn.k_scale, attn.v_scale, attn.sliding_window)
        plain = ctx.prefixes is None or attn.sliding_window
        return module.decode_attention(*args) if plain else cascade(*args, prefixes=ctx.prefixes)

    return AttentionBackend(name, module.store_kvcache, prefill, decode,
                            module.qk_norm_rope_store if name == "triton" else None)


# name -> (why it cannot run a configuration, what binds its kernels); "auto" tries them in order
BACKENDS: dict[str, tuple[Callable[..., list[str]], Callable[[], AttentionBackend]]] = {
    "triton": (cuda_backends.triton_unsupported, partial(_kernel_module_backend, "triton")),
    "flash-attn": (cuda_backends.flash_attn_unsupported,
                   partial(cuda_backends.flash_attn_backend, _kernel_module_backend)),
    "torch": (lambda *shape: [], partial(_kernel_module_backend, "torch")),
}


def resolve_backend(name: str, device: str, dtype: torch.dtype, block_size: int, head_dim: int,
                    kv_dtype: torch.dtype | None = None) -> str:
    """``name``, or for "auto" the first of BACKENDS that supports the configuration; logs why."""
    if name == "auto" and device == "cpu":  # the others need CUDA
        logger.info("attention backend: torch (the device is the CPU)")
        return "torch"
    skipped = []
    for backend in [name] if name != "auto" else BACKENDS:
        reasons = BACKENDS[backend][0](device, dtype, block_size, head_dim, kv_dtype or dtype)
        if not reasons:
            why = "; ".join(f"{b} skipped: {r}" for b, r in skipped)
            logger.info("attention backend: %s (%s)", backend, why or f"attention_backend={name!r}")
            return backend
        skipped.append((backend, ", ".join(reasons)))
    raise ValueError(f"attention_backend={name!r} does not support this configuration: "
                     f"{skipped[-1][1]}")


def bind_backend(name: str, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    return BACKENDS[name][1](dtype, head_dim)  # flash-attn's are checked for dtype and head_dim


class Attention(torch.nn.Module):
    """Paged attention over the layer's K/V cache views: a query at position i sees keys
    (i - sliding_window, i]. An fp8 cache holds K/V divided by ``k_scale``/``v_scale``."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads, self.sliding_window = num_kv_heads, sliding_window or 0
        self.k_scale = self.v_scale = 1.0
        self.k_cache = self.v_cache = torch.tensor([])  # set by the model runner, as is backend
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_stored: bool = False) -> torch.Tensor:
        # q [N, num_heads, head_dim], k, v [N, num_kv_heads, head_dim] -> [N, num_heads, head_dim]
        ctx = get_context()
        if not kv_stored:  # else the caller's fused prologue already wrote k, v into the cache
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping,
                                       self.k_scale, self.v_scale)
        if ctx.is_prefill:
            return self.backend.prefill(q, k, v, self, ctx)
        return self.backend.decode(q, self, ctx)
