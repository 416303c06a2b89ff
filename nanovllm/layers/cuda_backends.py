"""The CUDA attention backends' conditions (Triton's kernels, flash-attn's) and flash-attn's
binding; ``layers.attention`` chooses among them."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os

import torch

logger = logging.getLogger("nanovllm")


def flash_attn_backend(kernel_module_backend, dtype: torch.dtype, head_dim: int):
    """flash-attn's kernels, checked on tiny inputs first (a build may lack some dtypes and head
    sizes: a ValueError names the one missing); flash-attn 2 has no KV-store kernel: Triton's
    writes the cache."""
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    if error := _flash_attn_probe(dtype, head_dim):
        raise ValueError(f"attention_backend='flash-attn': this flash-attn build has no {dtype} "
                         f"head_dim {head_dim} kernel ({error})")
    triton = kernel_module_backend("triton")
    logger.info("attention backend flash-attn: no cascade attention (disable_cascade_attn=True), "
                "each sequence reads its shared prefix")

    def window(layer) -> tuple[int, int]:  # keys (i - w, i]
        return (layer.sliding_window - 1, 0) if layer.sliding_window else (-1, -1)

    def prefill(q, k, v, layer, ctx):
        if ctx.block_tables is not None:
            k, v = layer.k_cache, layer.v_cache
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=ctx.cu_seqlens_q,
                                      cu_seqlens_k=ctx.cu_seqlens_k, max_seqlen_q=ctx.max_seqlen_q,
                                      max_seqlen_k=ctx.max_seqlen_k, softmax_scale=layer.scale,
                                      causal=True, window_size=window(layer),
                                      block_table=ctx.block_tables)

    def decode(q, layer, ctx):
        out = flash_attn_with_kvcache(q.unsqueeze(1), layer.k_cache, layer.v_cache,
                                      cache_seqlens=ctx.context_lens, block_table=ctx.block_tables,
                                      softmax_scale=layer.scale, causal=True,
                                      window_size=window(layer))
        return out.squeeze(1)

    return dataclasses.replace(triton, name="flash-attn", prefill=prefill, decode=decode)


def triton_unsupported(device: str, dtype: torch.dtype, block_size: int, head_dim: int,
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


def flash_attn_unsupported(device: str, dtype: torch.dtype, block_size: int, head_dim: int,
                            kv_dtype: torch.dtype) -> list[str]:
    reasons = [f"{p} is not installed" for p in ("flash_attn", "triton")
               if importlib.util.find_spec(p) is None]
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
    return reasons


@functools.cache
def _flash_attn_probe(dtype: torch.dtype, head_dim: int) -> str:
    """The decode kernel's error on tiny inputs, or "": builds may lack some dtypes and head
    sizes."""
    from flash_attn import flash_attn_with_kvcache
    q = torch.zeros(1, 1, 1, head_dim, dtype=dtype, device="cuda")
    cache = torch.zeros(1, 256, 1, head_dim, dtype=dtype, device="cuda")
    try:
        flash_attn_with_kvcache(q, cache, cache,
                                cache_seqlens=torch.ones(1, dtype=torch.int32, device="cuda"),
                                block_table=torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
                                causal=True)
    except RuntimeError as e:
        return str(e).splitlines()[0][:120]
    return ""
