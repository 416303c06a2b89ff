"""vLLM's fused MoE in Triton, with ``moe_reference``'s functions: (token, expert) pairs grouped by
expert in runs padded to BLOCK_M, so each row tile of the two grouped GEMMs reads one expert; grids
fixed by the shapes (graphs). Block-wise fp8 experts are read as their e4m3 bytes and block scales;
their activations are quantized to e4m3 per token and group of bk columns (W8A8, as the dense
layers) or stay in their dtype (W8A16)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels import dot_precision, moe_reference
from nanovllm.kernels.fp8_reference import dequantize_fp8_block
from nanovllm.kernels.triton_fp8 import quantize_activations
from nanovllm.kernels.triton_linear import silu_mul_rounded


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """One token: its TOP_K largest softmax probabilities (the first index among equals)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(mask, p / tl.sum(p, 0), -1.0)
    ks = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        # NaN logits: in range
        idx = tl.minimum(tl.min(tl.where(p == best, offs, BLOCK_E), 0), num_experts - 1)
        weights = tl.where(ks == j, best, weights)
        ids = tl.where(ks == j, idx, ids)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + row * TOP_K + ks, weights, mask=ks < TOP_K)
    tl.store(ids_ptr + row * TOP_K + ks, ids, mask=ks < TOP_K)


def fused_topk(router_logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_reference.fused_topk``, the ids int32."""
    m, num_experts = router_logits.shape
    weights = torch.empty(m, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=router_logits.device)
    if m:
        _topk_softmax_kernel[(m,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
            RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k))
    return weights, ids


@triton.jit(do_not_specialize=["num_pairs", "capacity"])
def _moe_align_kernel(topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, cursor_ptr,
                      num_pairs, capacity, NUM_EXPERTS: tl.constexpr, NUM_BINS: tl.constexpr,
                      BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr):
    """One program: each expert's count, its run's start (into ``cursor``), each tile's expert, the
    sentinels; then each pair claims the next slot of its expert's run by an atomic add (any order
    will do)."""
    bins = tl.arange(0, NUM_BINS)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=0).to(tl.int32)
        counts += tl.histogram(ids, NUM_BINS, mask=offs < num_pairs)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(num_post_padded_ptr, total)
    tl.store(cursor_ptr + bins, padded_end - padded)
    num_tiles = capacity // BLOCK_M
    # a tile's expert: the number of runs ending at or before it
    for t0 in range(0, num_tiles, TILE_CHUNK):
        tiles = t0 + tl.arange(0, TILE_CHUNK)
        before = (padded_end[None, :] <= tiles[:, None] * BLOCK_M) & (bins[None, :] < NUM_EXPERTS)
        tl.store(expert_ids_ptr + tiles, tl.sum(before.to(tl.int32), 1), mask=tiles < num_tiles)
    for s0 in range(0, capacity, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs,
                 mask=offs < capacity)
    tl.debug_barrier()  # cursors and sentinels before any pair claims a slot
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < num_pairs
        ids = tl.load(topk_ids_ptr + offs, mask=mask, other=0).to(tl.int32)
        slot = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
        tl.store(sorted_ids_ptr + slot, offs.to(tl.int32), mask=mask)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """vLLM's (sorted_token_ids, expert_ids, num_tokens_post_padded): pairs (token * top_k + slot)
    by expert in runs padded to ``block_m`` with the sentinel M * top_k, each tile's expert, the
    padded total; worst-case sized."""
    pairs = topk_ids.numel()
    capacity = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    device = topk_ids.device
    sorted_token_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_experts)
    cursor = torch.empty(bins, dtype=torch.int32, device=device)
    _moe_align_kernel[(1,)](topk_ids.reshape(-1), sorted_token_ids, expert_ids, num_post_padded,
                            cursor, pairs, capacity, NUM_EXPERTS=num_experts, NUM_BINS=bins,
                            BLOCK_M=block_m, CHUNK=1024, TILE_CHUNK=max(1, 8192 // bins),
                            num_warps=8)
    return sorted_token_ids, expert_ids, num_post_padded


@triton.jit
def _partial_product(acc, a, a_scale, w_ptrs, w_mask, s_ptrs, k0, col_mask, dtype: tl.constexpr,
                     FP8_W: tl.constexpr, FP8_A: tl.constexpr, SCALE_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    """acc + a @ w.T of one K step; FP8_W: the step's product times its scale block's column
    scales (the step lies within one block of SCALE_K), w's e4m3 bytes multiplied with a's e4m3
    ones (FP8_A; times a's row scales too) or converted exactly to ``dtype`` in registers."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if FP8_W:
        scale = tl.load(s_ptrs + k0 // SCALE_K, mask=col_mask, other=0.0)
        if FP8_A:
            acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * scale[None, :]
        else:
            acc += tl.dot(a, tl.trans(w.to(dtype)), input_precision=PRECISION) * scale[None, :]
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


# one compilation for every batch size (CUDA graph buckets)
@triton.jit(do_not_specialize=["num_pairs"])
def _fused_moe_kernel(a_ptr, as_ptr, w_ptr, s_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr,
                      expert_ids_ptr, num_post_padded_ptr, n, k, num_pairs, stride_a, stride_as,
                      stride_we, stride_wn, stride_se, stride_sn, stride_c,
                      ROWS_PER_A: tl.constexpr, SILU_MUL: tl.constexpr,
                      MUL_ROUTED_WEIGHT: tl.constexpr, FP8_W: tl.constexpr, FP8_A: tl.constexpr,
                      SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """A tile of the sorted pairs, BLOCK_N columns of c[pair] = a[pair // ROWS_PER_A] @ w[expert].T;
    SILU_MUL: w is [gate; up] and c = SiLU(gate) * up; MUL_ROUTED_WEIGHT: c times the pair's routing
    weight. FP8_W: w is e4m3 with a scale per (SCALE_N x SCALE_K) block in
    s [E, ceil(rows / SCALE_N), ceil(k / SCALE_K)]; FP8_A: a is e4m3 too, with a scale per (row,
    group of SCALE_K columns) in as [rows of a, ceil(k / SCALE_K)] (W8A8), else a in the output's
    dtype (W8A16)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pairs < num_pairs  # padding rows hold num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    a_index = (pairs // ROWS_PER_A).to(tl.int64)
    a_rows = a_index[:, None] * stride_a
    as_rows = as_ptr + a_index * stride_as  # FP8_A only
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + expert * stride_se + (cols // SCALE_N) * stride_sn  # FP8_W only
    s_rows_up = s_ptr + expert * stride_se + ((n + cols) // SCALE_N) * stride_sn
    dtype = c_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        a = tl.load(a_ptr + a_rows + ks[None, :], mask=pair_mask[:, None] & k_mask[None, :],
                    other=0.0)
        a_scale = acc  # FP8_A only
        if FP8_A:
            a_scale = tl.load(as_rows + k0 // SCALE_K, mask=pair_mask, other=0.0)
        w_mask = col_mask[:, None] & k_mask[None, :]
        acc = _partial_product(acc, a, a_scale, w_rows + ks[None, :], w_mask, s_rows, k0,
                               col_mask, dtype, FP8_W, FP8_A, SCALE_K, PRECISION)
        if SILU_MUL:
            acc_up = _partial_product(acc_up, a, a_scale, w_rows + n * stride_wn + ks[None, :],
                                      w_mask, s_rows_up, k0, col_mask, dtype, FP8_W, FP8_A,
                                      SCALE_K, PRECISION)
    if SILU_MUL:
        acc = silu_mul_rounded(acc, acc_up, c_ptr)
    if MUL_ROUTED_WEIGHT:
        acc = (acc.to(dtype).to(tl.float32)
               * tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)[:, None])
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_c + cols[None, :], acc.to(dtype),
             mask=pair_mask[:, None] & col_mask[None, :])


def moe_config(num_tokens: int, num_experts: int, top_k: int,
               block: tuple[int, int] | None = None) -> dict:
    """BLOCK_M near the rows an expert gets on average; wider tiles once the runs are long. fp8
    experts of ``block`` (bn, bk): K steps of a whole block of the scales, up to 128 (1.4-1.6x at
    64-256 tokens, Qwen3-30B-A3B's experts on the H200, ``tools/bench_kernels.py --only moe
    --sweep``)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    elif rows_per_expert <= 64:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    if block is not None:
        cfg["BLOCK_K"] = min(block[1], 128)
    return cfg


def _grouped_gemm(a, w, scale, block, c, topk_weights, aligned, rows_per_a: int, gate_up: bool,
                  cfg: dict, w8a8: bool):
    """c [num_pairs, n]: gate/up with SiLU-and-mul, or (not gate_up) down times the routing weight;
    ``block`` (bn, bk): w is fp8 with block scales ``scale``, a K step stays within one block of
    bk, and with ``w8a8`` a is quantized per row and group of bk first."""
    sorted_ids, expert_ids, num_post_padded = aligned
    num_pairs, n = c.shape
    cfg = dict(cfg)
    if block is not None:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], block[1])
    fp8_a = block is not None and w8a8
    a_q, a_scale = quantize_activations(a, block[1]) if fp8_a else (a, a)
    grid = (expert_ids.numel(), triton.cdiv(n, cfg["BLOCK_N"]))
    s, (stride_se, stride_sn) = (w, (0, 0)) if block is None else (scale, scale.stride()[:2])
    _fused_moe_kernel[grid](a_q, a_scale, w, s, c, topk_weights, sorted_ids, expert_ids,
                            num_post_padded, n, a.size(1), num_pairs, a_q.stride(0),
                            a_scale.stride(0), w.stride(0), w.stride(1), stride_se, stride_sn,
                            c.stride(0), ROWS_PER_A=rows_per_a, SILU_MUL=gate_up,
                            MUL_ROUTED_WEIGHT=not gate_up, FP8_W=block is not None, FP8_A=fp8_a,
                            SCALE_N=block[0] if block else 1, SCALE_K=block[1] if block else 1,
                            PRECISION=dot_precision(a.dtype), **cfg)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, residual: torch.Tensor | None = None,
              config: dict | None = None, *, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block_shape=None,
              w8a8: bool = True) -> torch.Tensor:
    """``moe_reference.fused_moe``; ``config``: the tiles (``moe_config``'s by default). fp8 experts
    are read as e4m3, each K step's product times its block's scales; ``w8a8``: x and the
    intermediate quantized to e4m3 per token and group of bk columns (as ``fp8_linear`` does) and
    multiplied in fp8, else (W8A16) the experts converted in registers to x's dtype. A block whose
    bk is not a power of two >= 16 cannot hold whole K steps: those experts are dequantized
    first, W8A16 (``moe_reference.steps_through_blocks``)."""
    m, top_k = topk_ids.shape
    num_experts, two_i, _ = w13.shape
    block = moe_reference.check_fp8_experts(w13, w2, w13_scale, w2_scale, block_shape)
    if block is not None and not moe_reference.steps_through_blocks(block):
        w13, w2 = (dequantize_fp8_block(w, s, block, x.dtype)
                   for w, s in ((w13, w13_scale), (w2, w2_scale)))
        block = None
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_moe needs x, w13 and w2 contiguous in their last dimension")
    if block is not None and (w13_scale.stride(-1) != 1 or w2_scale.stride(-1) != 1):
        raise ValueError("fused_moe needs w13_scale and w2_scale contiguous in their last "
                         "dimension")
    out = (torch.empty(m, w2.size(1), dtype=x.dtype, device=x.device) if residual is None
           else residual)
    if m == 0:
        return out
    cfg = dict(config or moe_config(m, num_experts, top_k, block))
    aligned = moe_align_block_size(topk_ids, cfg["BLOCK_M"], num_experts)
    weights = topk_weights.float().contiguous()
    intermediate = torch.empty(m * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, w13_scale, block, intermediate, weights, aligned, top_k, True, cfg, w8a8)
    down = torch.empty(m, top_k, w2.size(1), dtype=x.dtype, device=x.device)
    _grouped_gemm(intermediate, w2, w2_scale, block, down.view(m * top_k, -1), weights, aligned, 1,
                  False, cfg, w8a8)
    if residual is None:
        return torch.sum(down, dim=1, out=out)
    return residual.add_(down.sum(dim=1))
