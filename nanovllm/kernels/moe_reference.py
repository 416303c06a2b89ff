"""The MoE layer in PyTorch (the CPU path, ``triton_moe``'s oracle); weights packed as vLLM's:
``w13 [E, 2 * I, H]`` (gate rows, then up), ``w2 [E, H, I]``, in x's dtype, or in float8_e4m3fn
with block scales ``w13_scale [E, ceil(2 * I / bn), ceil(H / bk)]``, ``w2_scale [E, ceil(H / bn),
ceil(I / bk)]`` (``block_shape`` = (bn, bk), a block-wise fp8 checkpoint's ``weight_scale_inv``
stacked). Its loop over the experts syncs with the host."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nanovllm.kernels.fp8_reference import FP8, dequantize_fp8_block, fake_quantize_activations
from nanovllm.kernels.reference import silu_and_mul


def fused_topk(router_logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [M, top_k], topk_ids [M, top_k]) of the float32 softmax over the
    experts."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def check_fp8_experts(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                      w2_scale: torch.Tensor | None, block_shape) -> tuple[int, int] | None:
    """``block_shape`` as a tuple when the experts are fp8 (None when they are not), after checking
    that fp8 weights come with both scales and a block, each scale of the shape its weight and block
    give, and that weights in another dtype come with none of them."""
    fp8 = w13.dtype == FP8
    if (w2.dtype == FP8) != fp8:
        raise TypeError(f"fused_moe: w13 is {w13.dtype} but w2 is {w2.dtype}: both fp8 or neither")
    given = [name for name, v in (("w13_scale", w13_scale), ("w2_scale", w2_scale),
                                  ("block_shape", block_shape))
             if v is not None]
    if not fp8:
        if given:
            raise ValueError(f"fused_moe: {', '.join(given)} given but the experts are "
                             f"{w13.dtype}, not fp8")
        return None
    if len(given) != 3:
        raise ValueError("fused_moe: float8_e4m3fn experts need w13_scale, w2_scale and "
                         f"block_shape; got {', '.join(given) or 'none of them'}")
    if not (len(block_shape) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_shape)):
        raise ValueError(f"fused_moe: block_shape must be two positive ints, got {block_shape!r}")
    bn, bk = block_shape
    for name, w, scale in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
        e, n, k = w.shape
        expected = (e, math.ceil(n / bn), math.ceil(k / bk))
        if tuple(scale.shape) != expected or scale.dtype != torch.float32:
            raise ValueError(f"fused_moe: {name} is {scale.dtype} {tuple(scale.shape)} but experts "
                             f"{tuple(w.shape)} with block_shape {tuple(block_shape)} need float32 "
                             f"{expected}")
    return bn, bk


def steps_through_blocks(block: tuple[int, int] | None) -> bool:
    """Whether fp8 experts of this block run W8A8 (and the kernel steps through their blocks of K
    without dequantizing them first): bk a power of two >= 16, as every published checkpoint's 128.
    Others run W8A16."""
    return block is not None and block[1] >= 16 and block[1] & (block[1] - 1) == 0


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, residual: torch.Tensor | None = None, *,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block_shape=None, w8a8: bool = True) -> torch.Tensor:
    """sum over k of topk_weights[:, k] * down_e(SiLU(gate_e(x)) * up_e(x)), e = topk_ids[:, k], for
    x [M, H]; each pair's output rounded to x's dtype, summed in float32. Added in place to
    ``residual`` when given. fp8 experts: each expert the batch routes to is dequantized, and with
    ``w8a8`` (where ``steps_through_blocks``) x and the intermediate go through e4m3 per row and
    group of bk columns, the products in float32 (float64 for a float64 x) rounded to x's dtype
    where the kernel rounds; else (W8A16) the expert is dequantized to x's dtype."""
    block = check_fp8_experts(w13, w2, w13_scale, w2_scale, block_shape)
    w8a8 = w8a8 and steps_through_blocks(block)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(x.size(0), w2.size(1), dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        rows, slots = torch.where(topk_ids == expert)
        w_gate_up, w_down, x_in = w13[expert], w2[expert], x[rows]
        if block is not None:
            dtype = compute if w8a8 else x.dtype
            w_gate_up = dequantize_fp8_block(w_gate_up, w13_scale[expert], block, dtype)
            w_down = dequantize_fp8_block(w_down, w2_scale[expert], block, dtype)
        if w8a8:
            x_in = fake_quantize_activations(x_in, block[1], compute)
        act = silu_and_mul(F.linear(x_in, w_gate_up).to(x.dtype))
        if w8a8:
            act = fake_quantize_activations(act, block[1], compute)
        weight = topk_weights[rows, slots].float().unsqueeze(1)
        y = F.linear(act, w_down).to(x.dtype).float() * weight
        out.index_add_(0, rows, y.to(x.dtype).float())
    out = out.to(x.dtype)
    return out if residual is None else residual.add_(out)
