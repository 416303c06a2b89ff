"""The attention layer and its backends: ``resolve_backend`` picks one at start-up, ``bind_backend`` imports its
kernels on each rank."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.utils.context import Context, get_context

logger = logging.getLogger("nanovllm")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kvcache: Callable  # (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale); slot -1 is skipped
    prefill: Callable  # (q, k, v, layer, ctx) -> [N, num_heads, head_dim]
    decode: Callable  # (q, layer, ctx) -> [B, num_heads, head_dim]
    qk_norm_rope_store: Callable | None = None  # optional: q/k RMSNorm, rotary and the KV store in one kernel


def _kernel_module_backend(name: str) -> AttentionBackend:
    """"torch" (``kernels/reference.py``) or "triton" (``kernels/triton_attention.py``)."""
    module = importlib.import_module("nanovllm.kernels." + ("triton_attention" if name == "triton" else "reference"))

    def prefill(q, k, v, layer: Attention, ctx: Context):
        return module.prefill_attention(q, k, v, layer.k_cache, layer.v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                        ctx.max_seqlen_q, ctx.block_tables, layer.scale, layer.k_scale, layer.v_scale,
                                        layer.sliding_window)

    def decode(q, layer: Attention, ctx: Context):
        return module.decode_attention(q, layer.k_cache, layer.v_cache, ctx.context_lens, ctx.block_tables,
                                       layer.scale, layer.k_scale, layer.v_scale, layer.sliding_window)

    return AttentionBackend(name, module.store_kvcache, prefill, decode,
                            module.qk_norm_rope_store if name == "triton" else None)


def _flash_attn_backend() -> AttentionBackend:
    """flash-attn 2 has no KV-store kernel: Triton's writes the cache."""
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    triton = _kernel_module_backend("triton")

    def window(layer: Attention) -> tuple[int, int]:  # keys (i - w, i]
        return (layer.sliding_window - 1, 0) if layer.sliding_window else (-1, -1)

    def prefill(q, k, v, layer: Attention, ctx: Context):
        if ctx.block_tables is not None:
            k, v = layer.k_cache, layer.v_cache
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=ctx.cu_seqlens_q, cu_seqlens_k=ctx.cu_seqlens_k,
                                      max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                                      softmax_scale=layer.scale, causal=True, window_size=window(layer),
                                      block_table=ctx.block_tables)

    def decode(q, layer: Attention, ctx: Context):
        out = flash_attn_with_kvcache(q.unsqueeze(1), layer.k_cache, layer.v_cache, cache_seqlens=ctx.context_lens,
                                      block_table=ctx.block_tables, softmax_scale=layer.scale, causal=True,
                                      window_size=window(layer))
        return out.squeeze(1)

    return AttentionBackend("flash-attn", triton.store_kvcache, prefill, decode, triton.qk_norm_rope_store)


def _triton_unsupported(device: str, dtype: torch.dtype, block_size: int, head_dim: int,
                        kv_dtype: torch.dtype) -> list[str]:
    reasons = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed")
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        reasons.append(f"device is {device} (Triton needs CUDA or TRITON_INTERPRET=1)")
    if block_size & (block_size - 1) or not 16 <= block_size <= 256:
        reasons.append(f"kvcache_block_size {block_size} (Triton: powers of two, 16-256)")
    if head_dim not in (32, 64, 128):
        reasons.append(f"head_dim {head_dim} (Triton: 32, 64, 128)")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        reasons.append(f"dtype {dtype}")
    if kv_dtype not in (dtype, torch.float8_e4m3fn):
        reasons.append(f"kv_cache_dtype {kv_dtype} (Triton: the model's dtype or fp8 e4m3)")
    elif kv_dtype != dtype and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        reasons.append("kv_cache_dtype fp8 (Triton needs compute capability 8.9+)")
    return reasons


def _flash_attn_unsupported(device: str, dtype: torch.dtype, block_size: int, head_dim: int,
                            kv_dtype: torch.dtype) -> list[str]:
    reasons = [f"{p} is not installed" for p in ("flash_attn", "triton") if importlib.util.find_spec(p) is None]
    if device != "cuda":
        reasons.append(f"device is {device}")
    if dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"dtype {dtype} (flash-attn: bf16, fp16)")
    if block_size % 256:
        reasons.append(f"kvcache_block_size {block_size} (flash-attn: multiples of 256)")
    if head_dim % 8 or head_dim > 256:
        reasons.append(f"head_dim {head_dim}")
    if kv_dtype != dtype:
        reasons.append(f"kv_cache_dtype {kv_dtype} (flash-attn: the model's dtype)")
    if not reasons and (error := _flash_attn_probe(dtype, head_dim)):
        reasons.append(f"this flash-attn build has no {dtype} head_dim {head_dim} kernel ({error})")
    return reasons


@functools.cache
def _flash_attn_probe(dtype: torch.dtype, head_dim: int) -> str:
    """The decode kernel's error on tiny inputs, or "": builds may lack some dtypes and head sizes."""
    from flash_attn import flash_attn_with_kvcache
    q = torch.zeros(1, 1, 1, head_dim, dtype=dtype, device="cuda")
    cache = torch.zeros(1, 256, 1, head_dim, dtype=dtype, device="cuda")
    try:
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.ones(1, dtype=torch.int32, device="cuda"),
                                block_table=torch.zeros(1, 1, dtype=torch.int32, device="cuda"), causal=True)
    except RuntimeError as e:
        return str(e).splitlines()[0][:120]
    return ""


# name -> (why it cannot run a configuration, what binds its kernels); "auto" tries them in order
BACKENDS: dict[str, tuple[Callable[..., list[str]], Callable[[], AttentionBackend]]] = {
    "triton": (_triton_unsupported, functools.partial(_kernel_module_backend, "triton")),
    "flash-attn": (_flash_attn_unsupported, _flash_attn_backend),
    "torch": (lambda *shape: [], functools.partial(_kernel_module_backend, "torch")),
}


def resolve_backend(name: str, device: str, dtype: torch.dtype, block_size: int, head_dim: int,
                    kv_dtype: torch.dtype | None = None) -> str:
    """``name``, or for "auto" the first of BACKENDS that supports the configuration; logs why."""
    kv_dtype = kv_dtype or dtype
    candidates = [name] if name != "auto" else [b for b in BACKENDS if device == "cuda" or b != "triton"]
    skipped = []
    for backend in candidates:
        reasons = BACKENDS[backend][0](device, dtype, block_size, head_dim, kv_dtype)
        if not reasons:
            why = "; ".join(f"{b} skipped: {r}" for b, r in skipped) or f"attention_backend={name!r}"
            logger.info("attention backend: %s (%s)", backend, why)
            return backend
        skipped.append((backend, ", ".join(reasons)))
    raise ValueError(f"attention_backend={name!r} does not support this configuration: {skipped[-1][1]}")


def bind_backend(name: str) -> AttentionBackend:
    return BACKENDS[name][1]()


class Attention(nn.Module):
    """Paged attention over the layer's K/V cache views; a query at position i sees keys (i - sliding_window, i].
    An fp8 cache holds K/V divided by ``k_scale``/``v_scale``."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.sliding_window = sliding_window or 0
        self.k_scale = self.v_scale = 1.0
        # set by the model runner
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_stored: bool = False) -> torch.Tensor:
        """q [N, num_heads, head_dim], k, v [N, num_kv_heads, head_dim] -> [N, num_heads, head_dim];
        ``kv_stored``: the caller's fused prologue already wrote k, v into the cache."""
        ctx = get_context()
        if not kv_stored:
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        if ctx.is_prefill:
            return self.backend.prefill(q, k, v, self, ctx)
        return self.backend.decode(q, self, ctx)
