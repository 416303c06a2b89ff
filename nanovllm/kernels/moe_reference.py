"""The mixture-of-experts layer in plain PyTorch (the router's top-k, the experts): the CPU path, and the oracle
of ``triton_moe``.

Weights are packed per layer as vLLM packs them: ``w13 [E, 2 * I, H]`` (each expert's gate rows, then its up
rows) and ``w2 [E, H, I]``; ``topk_ids``/``topk_weights`` ``[M, top_k]`` are the router's choice for each of
the M tokens. A loop over the experts the batch touches, as transformers computes it, so it syncs with the
host (the expert list): never captured in a CUDA graph, which is why CUDA tensors go to ``triton_moe``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.kernels.reference import silu_and_mul


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [M, top_k], topk_ids [M, top_k]): the softmax over experts in float32, its top-k,
    renormalized to sum to 1 when ``renormalize`` (the checkpoint's ``norm_topk_prob``). The weights stay
    in float32, as vLLM keeps them (transformers rounds them to the model's dtype)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """sum over k of topk_weights[:, k] * down_e(SiLU(gate_e(x)) * up_e(x)), e = topk_ids[:, k], for x [M, H]:
    each (token, expert) pair's output rounded to x's dtype, the sum over top-k in float32. With ``residual``
    the result is added to it in place and it is returned."""
    out = torch.zeros(x.size(0), w2.size(1), dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        rows, slots = torch.where(topk_ids == expert)
        act = silu_and_mul(F.linear(x[rows], w13[expert]))
        y = F.linear(act, w2[expert]).float() * topk_weights[rows, slots].float().unsqueeze(1)
        out.index_add_(0, rows, y.to(x.dtype).float())
    out = out.to(x.dtype)
    return out if residual is None else residual.add_(out)
