"""The mixture-of-experts layer's experts in Triton: vLLM's fused MoE design, in three steps.

1. ``moe_align_block_size``: the M * top_k (token, expert) pairs the router chose are sorted by expert,
   and each expert's run is padded to a multiple of BLOCK_M, so that every tile of BLOCK_M sorted rows
   belongs to one expert (``expert_ids[tile]``); padding rows hold the sentinel M * top_k.
2. One grouped GEMM for gate and up (``w13``): a program takes one tile of rows and BLOCK_N columns of
   its expert's gate and the same columns of its up, and stores SiLU(gate) * up (the activation in the
   epilogue, as the skinny dense kernel does) into the pairs' rows of the intermediate [M * top_k, I].
3. One grouped GEMM for down (``w2``), each row scaled by its pair's routing weight in the epilogue,
   into [M, top_k, H], then the sum over top-k (and the residual add).

A tile reads only its expert's weights: a step reads the weights of the experts its batch touches,
once per tile of their rows (once at decode batch sizes, where an expert gets a few rows). Nothing here
waits for the host: the grid is sized by the most tiles the padding can make (known from the shapes),
and tiles past the padded total (a device scalar) return at once, so decode graphs capture it.

Same function as ``moe_reference.fused_moe`` (the oracle and the CPU path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels import dot_precision


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) for topk_ids [M, top_k] (vLLM's names).

    ``sorted_token_ids`` [capacity]: pair indices (token * top_k + slot) grouped by expert, each group
    padded to a multiple of ``block_m`` with the sentinel M * top_k; ``expert_ids`` [capacity / block_m]:
    each tile's expert (num_experts past the end); ``num_tokens_post_padded`` [1]: the padded total.
    Device ops only (no host sync; CUDA-graph capturable); capacity is a function of the shapes alone:
    the pairs plus at most block_m - 1 padding rows for each expert that can be touched."""
    pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1)
    capacity = pairs + min(num_experts, pairs) * (block_m - 1)
    capacity = triton.cdiv(capacity, block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int64))   # bincount would sync (it sizes by the max)
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_start, start = padded_end - (counts + block_m - 1) // block_m * block_m, torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)               # pair indices by expert, in token order within one
    expert = flat[order].long()
    dest = padded_start[expert] + torch.arange(pairs, device=flat.device) - start[expert]
    sorted_token_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=flat.device)
    sorted_token_ids[dest] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, tile_starts, right=True).to(torch.int32)
    return sorted_token_ids, expert_ids, padded_end[-1:].to(torch.int32)


@triton.jit(do_not_specialize=["num_pairs"])  # one compilation for every batch size (CUDA graph buckets)
def _fused_moe_kernel(a_ptr, w_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
                      n, k, num_pairs, stride_a, stride_we, stride_wn, stride_c,
                      ROWS_PER_A: tl.constexpr, SILU_MUL: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Tile ``program_id(0)`` of the sorted pairs, columns [program_id(1) * BLOCK_N, +BLOCK_N) of
    c[pair] = a[pair // ROWS_PER_A] @ w[expert].T; with SILU_MUL w[expert] is [gate; up] (2n rows) and
    c = SiLU(gate) * up; with MUL_ROUTED_WEIGHT c is scaled by the pair's routing weight."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return  # a tile past the padded total: the grid is sized for the worst case
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pairs < num_pairs  # padding rows hold num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)[:, None] * stride_a
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        a = tl.load(a_ptr + a_rows + ks[None, :], mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = col_mask[:, None] & k_mask[None, :]
        acc = tl.dot(a, tl.trans(tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)), acc,
                     input_precision=PRECISION)
        if SILU_MUL:
            w_up = tl.load(w_rows + n * stride_wn + ks[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up, input_precision=PRECISION)
    if SILU_MUL:  # rounded where the reference rounds: the projections, then SiLU(gate)
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    if MUL_ROUTED_WEIGHT:
        acc = acc.to(dtype).to(tl.float32) * tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_c + cols[None, :], acc.to(dtype),
             mask=pair_mask[:, None] & col_mask[None, :])


def moe_config(num_tokens: int, num_experts: int, top_k: int) -> dict:
    """Tile sizes: BLOCK_M near the rows an expert gets on average (M * top_k / E; decode's few rows
    waste little padding at 16), wider tiles once the experts' runs are long (prefill)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def _grouped_gemm(a, w, c, topk_weights, aligned, num_pairs: int, n: int, rows_per_a: int, silu_mul: bool,
                  mul_routed_weight: bool, cfg: dict):
    sorted_ids, expert_ids, num_post_padded = aligned
    grid = (expert_ids.numel(), triton.cdiv(n, cfg["BLOCK_N"]))
    _fused_moe_kernel[grid](a, w, c, topk_weights, sorted_ids, expert_ids, num_post_padded, n, a.size(1), num_pairs,
                            a.stride(0), w.stride(0), w.stride(1), c.stride(0), ROWS_PER_A=rows_per_a,
                            SILU_MUL=silu_mul, MUL_ROUTED_WEIGHT=mul_routed_weight, PRECISION=dot_precision(a.dtype),
                            **cfg)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, residual: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """sum over k of topk_weights[:, k] * down_e(SiLU(gate_e(x)) * up_e(x)), e = topk_ids[:, k], for x [M, H]
    (w13 [E, 2 * I, H], w2 [E, H, I]). With ``residual`` the result is added to it in place and it is
    returned. ``config``: tile sizes (by default ``moe_config``'s)."""
    m, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_moe needs x, w13 and w2 contiguous in their last dimension")
    out = torch.empty(m, w2.size(1), dtype=x.dtype, device=x.device) if residual is None else residual
    if m == 0:
        return out
    cfg = dict(config or moe_config(m, num_experts, top_k))
    aligned = moe_align_block_size(topk_ids, cfg["BLOCK_M"], num_experts)
    weights = topk_weights.float().contiguous()
    intermediate = torch.empty(m * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, intermediate, weights, aligned, m * top_k, two_i // 2, top_k, True, False, cfg)
    down = torch.empty(m, top_k, w2.size(1), dtype=x.dtype, device=x.device)
    _grouped_gemm(intermediate, w2, down.view(m * top_k, -1), weights, aligned, m * top_k, w2.size(1), 1, False,
                  True, cfg)
    if residual is None:
        return torch.sum(down, dim=1, out=out)
    return residual.add_(down.sum(dim=1))
