"""The MoE layer in PyTorch (the CPU path, ``triton_moe``'s oracle); weights packed as vLLM's: ``w13 [E, 2 * I, H]``
(gate rows, then up), ``w2 [E, H, I]``. Its loop over the experts syncs with the host."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.kernels.reference import silu_and_mul


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [M, top_k], topk_ids [M, top_k]) of the float32 softmax over the experts."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """sum over k of topk_weights[:, k] * down_e(SiLU(gate_e(x)) * up_e(x)), e = topk_ids[:, k], for x [M, H];
    each pair's output rounded to x's dtype, summed in float32. Added in place to ``residual`` when given."""
    out = torch.zeros(x.size(0), w2.size(1), dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        rows, slots = torch.where(topk_ids == expert)
        act = silu_and_mul(F.linear(x[rows], w13[expert]))
        y = F.linear(act, w2[expert]).float() * topk_weights[rows, slots].float().unsqueeze(1)
        out.index_add_(0, rows, y.to(x.dtype).float())
    out = out.to(x.dtype)
    return out if residual is None else residual.add_(out)
