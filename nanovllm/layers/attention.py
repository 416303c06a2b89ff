"""The attention layer and its backends.

The layer stores new K/V into the paged cache at ``slot_mapping``, then runs the prefill or
decode kernel of the backend chosen once at start-up: our Triton kernels on CUDA, flash-attn
when installed, or the PyTorch reference (any device, the test oracle). ``select_backend``
picks the first that supports the device, dtype, block size and head_dim, and says why.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os

import torch
from torch import nn

from nanovllm.utils.context import Context, get_context

logger = logging.getLogger("nanovllm")


class KernelModuleBackend:
    """A backend whose kernels are one of our modules with ``reference.py``'s functions and signatures."""

    module = "nanovllm.kernels.reference"

    @classmethod
    def store_kvcache(cls, k, v, k_cache, v_cache, slot_mapping):
        importlib.import_module(cls.module).store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    @classmethod
    def prefill(cls, q, k, v, k_cache, v_cache, ctx: Context, scale: float):
        return importlib.import_module(cls.module).prefill_attention(
            q, k, v, k_cache, v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.block_tables, scale)

    @classmethod
    def decode(cls, q, k_cache, v_cache, ctx: Context, scale: float):
        return importlib.import_module(cls.module).decode_attention(q, k_cache, v_cache, ctx.context_lens,
                                                                    ctx.block_tables, scale)


class TorchBackend(KernelModuleBackend):
    """Plain PyTorch paged attention: any device, dtype, block size and head_dim."""

    name = "torch"

    @staticmethod
    def unsupported(device: str, dtype: torch.dtype, block_size: int, head_dim: int) -> list[str]:
        return []


class TritonBackend(KernelModuleBackend):
    """Our Triton kernels (imported on first use: triton ships for Linux only); on CPU only under
    TRITON_INTERPRET=1, which the tests use."""

    name = "triton"
    module = "nanovllm.kernels.triton_attention"
    HEAD_DIMS = (32, 64, 128)

    @classmethod
    def qk_norm_rope_store(cls, *args):
        """q/k RMSNorm, rotary and the KV store in one kernel (``triton_attention.qk_norm_rope_store``)."""
        return importlib.import_module(cls.module).qk_norm_rope_store(*args)

    @staticmethod
    def unsupported(device: str, dtype: torch.dtype, block_size: int, head_dim: int) -> list[str]:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("triton is not installed")
        if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            reasons.append(f"device is {device} (Triton runs on CUDA, or anywhere with TRITON_INTERPRET=1)")
        if block_size & (block_size - 1) or not 16 <= block_size <= 256:
            reasons.append(f"kvcache_block_size {block_size} (Triton: powers of two, 16-256)")
        if head_dim not in TritonBackend.HEAD_DIMS:
            reasons.append(f"head_dim {head_dim} (Triton: {', '.join(map(str, TritonBackend.HEAD_DIMS))})")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"dtype {dtype}")
        return reasons


class FlashAttnBackend:
    """flash-attn 2: varlen prefill (paged when part of the keys are cached) and paged decode."""

    name = "flash-attn"

    @staticmethod
    def unsupported(device: str, dtype: torch.dtype, block_size: int, head_dim: int) -> list[str]:
        reasons = []
        if importlib.util.find_spec("flash_attn") is None:
            reasons.append("flash_attn is not installed")
        if device != "cuda":
            reasons.append(f"device is {device}")
        if dtype not in (torch.bfloat16, torch.float16):
            reasons.append(f"dtype {dtype} (flash-attn: bf16, fp16)")
        if block_size % 256:
            reasons.append(f"kvcache_block_size {block_size} (flash-attn paged KV: multiples of 256)")
        if head_dim % 8 or head_dim > 256:
            reasons.append(f"head_dim {head_dim}")
        if not reasons and (error := _flash_attn_probe(dtype, head_dim)):
            reasons.append(f"this flash-attn build has no {dtype} head_dim {head_dim} kernel ({error})")
        return reasons

    store_kvcache = TritonBackend.store_kvcache
    qk_norm_rope_store = TritonBackend.qk_norm_rope_store

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


@functools.cache
def _flash_attn_probe(dtype: torch.dtype, head_dim: int) -> str:
    """Builds may be trimmed to some dtypes and head sizes: try the decode kernel once on tiny inputs."""
    from flash_attn import flash_attn_with_kvcache
    q = torch.zeros(1, 1, 1, head_dim, dtype=dtype, device="cuda")
    cache = torch.zeros(1, 256, 1, head_dim, dtype=dtype, device="cuda")
    try:
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.ones(1, dtype=torch.int32, device="cuda"),
                                block_table=torch.zeros(1, 1, dtype=torch.int32, device="cuda"), causal=True)
    except RuntimeError as e:
        return str(e).splitlines()[0][:120]
    return ""


# "auto" tries them in this order: fastest first (our Triton kernels beat flash-attn 2.8.3 at every
# measured shape on an H200: docs/PERFORMANCE.md), then flash-attn for what Triton does not cover
# (e.g. blocks of 512), then the reference.
BACKENDS = {b.name: b for b in (TritonBackend, FlashAttnBackend, TorchBackend)}


def select_backend(name: str, device: str, dtype: torch.dtype, block_size: int, head_dim: int,
                   log: bool = True):
    """The backend called ``name``, or with "auto" the first in BACKENDS that supports the shapes;
    the choice and why the others were passed over are logged (by rank 0)."""
    candidates = [BACKENDS[name]] if name != "auto" else \
        [b for b in BACKENDS.values() if device == "cuda" or b is not TritonBackend]  # the interpreter: on request only
    skipped = []
    for backend in candidates:
        reasons = backend.unsupported(device, dtype, block_size, head_dim)
        if not reasons:
            why = "; ".join(f"{b} skipped: {r}" for b, r in skipped) or f"attention_backend={name!r}"
            if log:
                logger.info("attention backend: %s (%s)", backend.name, why)
            return backend
        skipped.append((backend.name, ", ".join(reasons)))
    raise ValueError(f"attention_backend={name!r} does not support this configuration: {skipped[-1][1]}")


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        # Set by the model runner: views of its KV-cache tensor, and the backend.
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = TorchBackend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_stored: bool = False) -> torch.Tensor:
        # q [N, num_heads, head_dim]; k, v [N, num_kv_heads, head_dim] -> [N, num_heads, head_dim];
        # kv_stored: the caller's fused prologue (qk_norm_rope_store) already wrote k, v into the cache
        ctx = get_context()
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache.numel() and not kv_stored:  # no cache during the warmup forward that sizes it
            self.backend.store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            return self.backend.prefill(q, k, v, k_cache, v_cache, ctx, self.scale)
        return self.backend.decode(q, k_cache, v_cache, ctx, self.scale)
