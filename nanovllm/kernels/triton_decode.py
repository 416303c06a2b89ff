"""A dense decoder's decode step (all its layers) as one persistent Triton kernel: a grid of programs that are all
resident at once (the caller runs two per SM) loops over the layers and ``decode_plan``'s stages, and the stages meet
at grid barriers (counters in global memory) instead of kernel boundaries. Written in Triton, not CUDA C++: the grid
barrier and the split merges are atomics and spin loops that Triton expresses, the interpreter runs the same code on
CPU (one program: every barrier is already met), and there is nothing to build at first use. Each task's next
weights are loaded before its current chunk's math; optionally (``prefetch``) a program also asks L2 for its next
stage's weights before it waits at a barrier.

Rounding follows the unfused kernels: the norm's output, q/k after norm and rotary, each projection's output and
the residual stream in the model's dtype, accumulators in fp32.

fp8 weights (``DecodePlan.fp8``) follow ``triton_fp8``'s skinny kernel, the engine's fp8 decode: e4m3 bytes converted
exactly to the model's dtype in registers, the activations quantized to e4m3 as the engine's W8A8 does; block-wise,
per row and weight block (a load holds whole blocks, or all of K), each block's product times both scales; per
channel, per token (the norm's output by each task, over its whole row; the attention's and
the MLP's by their readers, from the row's amax that their writers gather with atomics) and both scales on the
accumulator."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode_plan import BLOCK_M, BLOCK_N, MAX_ATTENTION_SPLITS, STAGES, DecodePlan
from nanovllm.kernels.triton_attention import LOG2E, _attend_tile
from nanovllm.kernels.triton_fp8 import _row_scale, _to_e4m3
from nanovllm.kernels.triton_linear import silu_mul_rounded

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# columns of the per-layer pointer table (a projection's fp8 scales: 0 for weights in the model's dtype)
TABLE = ("input_layernorm", "qkv_proj", "qkv_bias", "q_norm", "k_norm", "o_proj", "post_attention_layernorm",
         "gate_up_proj", "down_proj", "qkv_proj_scale", "o_proj_scale", "gate_up_proj_scale", "down_proj_scale")
TABLE_WIDTH = tl.constexpr(len(TABLE))
FP8_MODES = {None: 0, "block": 1, "channel": 2}  # the kernel's FP8, from DecodePlan.fp8
FP8_BLOCK, FP8_CHANNEL = tl.constexpr(1), tl.constexpr(2)
NUM_STAGES = tl.constexpr(len(STAGES))
_BLOCK_N, _BLOCK_M = tl.constexpr(BLOCK_N), tl.constexpr(BLOCK_M)  # as kernels may read them
MAX_SPLITS = tl.constexpr(MAX_ATTENTION_SPLITS)
MAX_SPINS = tl.constexpr(1 << 21)  # ~1 s of polling: a barrier never met (programs not co-resident) gives up


@triton.jit
def _ptr(table, column: tl.constexpr, dtype: tl.constexpr):
    return tl.multiple_of(tl.load(table + column).to(tl.pointer_type(dtype)), 16)  # parameters are 16-byte aligned


@triton.jit
def _grid_barrier(sync_ptr, target, SPIN_ASM: tl.constexpr):
    """Arrives at the barrier counter and waits for ``target`` arrivals (``DecodePlan.barrier_target``). After
    MAX_SPINS polls it sets the timeout flag, and later barriers of the launch wait no more."""
    tl.debug_barrier()
    seen = tl.atomic_add(sync_ptr, 1, sem="acq_rel") + 1
    spins = tl.where(tl.load(sync_ptr + 1, volatile=True) != 0, MAX_SPINS, 0)
    while (seen < target) & (spins < MAX_SPINS):
        if SPIN_ASM:
            seen = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [sync_ptr],
                                             dtype=tl.int32, is_pure=False, pack=1)
        else:
            seen = tl.atomic_add(sync_ptr, 0, sem="acquire")
        spins += 1
    if seen < target:
        tl.atomic_max(sync_ptr + 1, 1)
    tl.debug_barrier()


@triton.jit
def _mark(trace_ptr, pid, layer, num_layers, stage: tl.constexpr, point: tl.constexpr, TRACE: tl.constexpr):
    """TRACE: the global timer (ns) at ``point`` (0: stage start, 1: tasks done, 2: barrier passed) into
    trace [programs, layers, stages, 3]."""
    if TRACE:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                        pack=1)
        tl.store(trace_ptr + ((pid * num_layers + layer) * NUM_STAGES + stage) * 3 + point, now)


@triton.jit
def _last_arrival(counter_ptr, splits):
    """True in the one task of ``splits`` that arrives last (the counter is then reset for the next layer)."""
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == splits - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0)
    tl.debug_barrier()
    return last


@triton.jit
def _quantized(x, scale, ROUND_FP8: tl.constexpr):
    """x [rows, k] as e4m3 values (x / scale per row, saturated; ``triton_fp8.quantize_activations``'s) in x's
    dtype, which holds them exactly."""
    return _to_e4m3(x, scale, ROUND_FP8).to(x.dtype)


@triton.jit
def _chunk_dot(acc, x, w, scale_ptr, k0, BLOCK_K: tl.constexpr, FP8: tl.constexpr, SCALE_K: tl.constexpr,
               PRECISION: tl.constexpr, ROUND_FP8: tl.constexpr):
    """acc + x @ w.T over K columns [k0, k0 + BLOCK_K), w converted to x's dtype (exactly, from e4m3). Block-wise
    fp8 (BLOCK_K a multiple of SCALE_K): x quantized per row and scale block, as ``triton_fp8``'s kernels do, and
    each block's product times x's and the weight block's scales (scale_ptr: each column's row of scales); a chunk
    wider than a block takes a product per block, of x with the other blocks' columns zeroed."""
    w = w.to(x.dtype)
    if FP8 == FP8_BLOCK:
        block = tl.arange(0, BLOCK_K)[None, :] // SCALE_K
        for j in tl.static_range((BLOCK_K + SCALE_K - 1) // SCALE_K):  # a load of all of K may be < a block
            xj = tl.where(block == j, x, tl.zeros_like(x))
            x_scale = _row_scale(tl.max(tl.abs(xj.to(tl.float32)), 1))
            part = tl.dot(_quantized(xj, x_scale, ROUND_FP8), tl.trans(w), input_precision=PRECISION)
            acc += part * x_scale[:, None] * tl.load(scale_ptr + k0 // SCALE_K + j)[None, :]
        return acc
    return tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _gather_amax(amax_ptr, y, mask):
    """The largest |y| of each row (y [rows, cols], rows where ``mask``) into amax_ptr[row], as int32 bits: a
    non-negative float's bits order as the float does."""
    y = tl.where(mask, tl.abs(y.to(tl.float32)), 0.0)
    tl.atomic_max(amax_ptr, tl.max(y, 1).to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _normed(r_ptr, norm_ptr, rows, row_mask, k0, ks, rstd, K: tl.constexpr):
    """Columns k0 + ks of RMSNorm(r), r [rows, K], rounded where the unfused RMSNorm rounds."""
    dtype = r_ptr.dtype.element_ty
    x = tl.load(r_ptr + rows[:, None] * K + k0 + ks[None, :], mask=row_mask, other=0.0, cache_modifier=".cg")
    nw = tl.load(norm_ptr + k0 + ks).to(tl.float32)[None, :]
    return (nw * (x.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _normed_gemv(r_ptr, norm_ptr, w_ptr, s_ptr, b_ptr, out_ptr, amax_ptr, m, tile, eps, K: tl.constexpr,
                 N: tl.constexpr, GATE_UP: tl.constexpr, BIAS: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                 ROUND_FP8: tl.constexpr):
    """Columns [tile * _BLOCK_N, +_BLOCK_N) of RMSNorm(r) @ w.T (+ bias), or with GATE_UP of SiLU(gate) * up where w
    is [gate; up] of N rows each; r [m, K], out [m, N]. fp8 weights: s the scales (block-wise [rows / SCALE_N,
    K / SCALE_K], or per channel [rows]); per channel, the norm's output quantized per token, and with GATE_UP each
    output row's amax gathered into amax_ptr[row] for the next stage."""
    dtype = r_ptr.dtype.element_ty
    rows = tl.arange(0, _BLOCK_M)
    row_mask = (rows < m)[:, None]
    cols = tile * _BLOCK_N + tl.arange(0, _BLOCK_N)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    s_rows = s_ptr + (cols // SCALE_N) * ((K + SCALE_K - 1) // SCALE_K)  # block-wise: each column's scales
    s_up_rows = s_ptr + ((N + cols) // SCALE_N) * ((K + SCALE_K - 1) // SCALE_K)
    ks = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + ks[None, :])  # the first weights in flight while the norm's sum runs
    w_up = tl.load(w_rows + N * K + ks[None, :]) if GATE_UP else w
    ss = tl.zeros([_BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(r_ptr + rows[:, None] * K + k0 + ks[None, :], mask=row_mask, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        ss += tl.sum(x * x, 1)
    rstd = tl.rsqrt(ss / K + eps)[:, None]
    if FP8 == FP8_CHANNEL:  # the token's scale: the amax of its normed row
        amax = tl.zeros([_BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            amax = tl.maximum(amax, tl.max(tl.abs(_normed(r_ptr, norm_ptr, rows, row_mask, k0, ks, rstd, K)
                                                  .to(tl.float32)), 1))
        x_scale = _row_scale(amax)
    acc = tl.zeros([_BLOCK_M, _BLOCK_N], tl.float32)
    acc_up = tl.zeros([_BLOCK_M, _BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        nxt = (k0 + BLOCK_K + ks)[None, :]  # the next weights' loads go out before this chunk's math
        w_next = tl.load(w_rows + nxt, mask=nxt < K, other=0.0)
        w_up_next = tl.load(w_rows + N * K + nxt, mask=nxt < K, other=0.0) if GATE_UP else w_next
        x = _normed(r_ptr, norm_ptr, rows, row_mask, k0, ks, rstd, K)
        if FP8 == FP8_CHANNEL:
            x = _quantized(x, x_scale, ROUND_FP8)
        acc = _chunk_dot(acc, x, w, s_rows, k0, BLOCK_K, FP8, SCALE_K, PRECISION, ROUND_FP8)
        if GATE_UP:
            acc_up = _chunk_dot(acc_up, x, w_up, s_up_rows, k0, BLOCK_K, FP8, SCALE_K, PRECISION, ROUND_FP8)
        w, w_up = w_next, w_up_next
    if FP8 == FP8_CHANNEL:  # the weight's scales, then the token's, as the skinny kernel
        acc = acc * tl.load(s_ptr + cols)[None, :] * x_scale[:, None]
        if GATE_UP:
            acc_up = acc_up * tl.load(s_ptr + N + cols)[None, :] * x_scale[:, None]
    if BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    if GATE_UP:
        acc = silu_mul_rounded(acc, acc_up, r_ptr)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(dtype), mask=row_mask)
    if FP8 == FP8_CHANNEL and GATE_UP:
        _gather_amax(amax_ptr + rows, acc.to(dtype), row_mask)


@triton.jit
def _split_gemv_add(x_ptr, w_ptr, s_ptr, amax_ptr, r_ptr, part_ptr, counters, m, task, K: tl.constexpr,
                    N: tl.constexpr, SPLITS: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                    FP8: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, ROUND_FP8: tl.constexpr):
    """Task ``task`` = (tile, K split) of r += x @ w.T, x [m, K], r [m, N]: the last split of a tile to arrive adds
    the fp32 partial sums (part [SPLITS, _BLOCK_M, N]) and the residual. fp8 weights: s their scales (as
    ``_normed_gemv``'s); per channel, x quantized per token by the amax of its row in amax_ptr[row]."""
    tile, split = task // SPLITS, task % SPLITS
    rows = tl.arange(0, _BLOCK_M)
    row_mask = (rows < m)[:, None]
    cols = tile * _BLOCK_N + tl.arange(0, _BLOCK_N)
    acc = tl.zeros([_BLOCK_M, _BLOCK_N], tl.float32)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    s_rows = s_ptr + (cols // SCALE_N) * ((K + SCALE_K - 1) // SCALE_K)  # block-wise: each column's scales
    ks = tl.arange(0, BLOCK_K)
    end = (split + 1) * (K // SPLITS)
    w = tl.load(w_rows + split * (K // SPLITS) + ks[None, :])
    if FP8 == FP8_CHANNEL:
        amax = tl.load(amax_ptr + rows, mask=rows < m, other=0, cache_modifier=".cg")
        x_scale = _row_scale(amax.to(tl.float32, bitcast=True))
    for k0 in range(split * (K // SPLITS), end, BLOCK_K):
        nxt = (k0 + BLOCK_K + ks)[None, :]  # the next weights' loads go out before this chunk's math
        w_next = tl.load(w_rows + nxt, mask=nxt < end, other=0.0)
        x = tl.load(x_ptr + rows[:, None] * K + k0 + ks[None, :], mask=row_mask, other=0.0, cache_modifier=".cg")
        if FP8 == FP8_CHANNEL:
            x = _quantized(x, x_scale, ROUND_FP8)
        acc = _chunk_dot(acc, x, w, s_rows, k0, BLOCK_K, FP8, SCALE_K, PRECISION, ROUND_FP8)
        w = w_next
    if FP8 == FP8_CHANNEL:
        acc = acc * tl.load(s_ptr + cols)[None, :] * x_scale[:, None]
    out = r_ptr + rows[:, None] * N + cols[None, :]
    if SPLITS == 1:
        tl.store(out, (acc + tl.load(out, mask=row_mask, other=0.0).to(tl.float32)).to(r_ptr.dtype.element_ty),
                 mask=row_mask)
    else:
        part = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(part + split * (_BLOCK_M * N), acc)
        if _last_arrival(counters + tile, SPLITS):
            total = tl.load(out, mask=row_mask, other=0.0).to(tl.float32)
            for s in range(SPLITS):
                total += tl.load(part + s * (_BLOCK_M * N), cache_modifier=".cg")
            tl.store(out, total.to(r_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _norm_rope(ptr, rows_mask, norm_ptr, pos, cos_sin_ptr, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    """Heads [R, HEAD_DIM] at ptr (rows HEAD_DIM apart) after their RMSNorm (NORM) and rotary (rotate-half);
    the partner of element d is d +- HEAD_DIM / 2."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    partner = (d + HALF) % HEAD_DIM
    x = tl.load(ptr + d[None, :], mask=rows_mask, other=0.0, cache_modifier=".cg")
    xp = tl.load(ptr + partner[None, :], mask=rows_mask, other=0.0, cache_modifier=".cg")
    dtype = x.dtype
    if NORM:
        f = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(f * f, 1) / HEAD_DIM + eps)[:, None]
        x = (tl.load(norm_ptr + d).to(tl.float32)[None, :] * (f * rstd).to(dtype).to(tl.float32)).to(dtype)
        xp = (tl.load(norm_ptr + partner).to(tl.float32)[None, :] * (xp.to(tl.float32) * rstd).to(dtype)
              .to(tl.float32)).to(dtype)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + d % HALF).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + d % HALF).to(tl.float32)[None, :]
    sign = tl.where(d < HALF, -1.0, 1.0)[None, :]
    return (x.to(tl.float32) * cos + sign * xp.to(tl.float32) * sin).to(dtype)


@triton.jit
def _attention_task(qkv_ptr, attn_ptr, part_o_ptr, part_lse_ptr, counters, amax_ptr, k_cache, v_cache, q_norm,
                    k_norm, cos_sin_ptr, pos_ptr, slot_ptr, ctx_ptr, bt_ptr, stride_bt, task, splits, eps, qk_scale,
                    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_G: tl.constexpr, PAGE: tl.constexpr, ATTN_BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                    NORM: tl.constexpr, PRECISION: tl.constexpr, AMAX: tl.constexpr):
    """Task (sequence, KV head, split): the group's q heads after norm and rotary over the split's keys, as
    ``_decode_kernel``; the split holding the newest position first writes its K/V into the cache. The split to
    arrive last merges them into attn [B, NUM_HEADS * HEAD_DIM] (``_merge_kernel``'s log-sum-exp). AMAX: the
    largest |value| written into amax_ptr[sequence] (``_gather_amax``)."""
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    QKV: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    seq, kv_head, split = task // (NUM_KV_HEADS * splits), (task // splits) % NUM_KV_HEADS, task % splits
    ctx = tl.load(ctx_ptr + seq)
    pos = tl.load(pos_ptr + seq).to(tl.int64)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(ctx - WINDOW, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - first, splits), ATTN_BLOCK_N) * ATTN_BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    row = qkv_ptr + seq * QKV
    q = _norm_rope(row + (kv_head * GROUP + g)[:, None] * HEAD_DIM, (g < GROUP)[:, None], q_norm, pos, cos_sin_ptr,
                   eps, HEAD_DIM, NORM)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if (start <= ctx - 1) & (ctx - 1 < end) & (slot >= 0):
        first_row = (g == 0)[:, None]
        k = _norm_rope(row + (NUM_HEADS + kv_head) * HEAD_DIM + 0 * g[:, None], first_row, k_norm, pos, cos_sin_ptr,
                       eps, HEAD_DIM, NORM)
        cache_at = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :] + 0 * g[:, None]
        tl.store(k_cache + cache_at, k, mask=first_row)
        v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :] + 0 * g[:, None],
                    mask=first_row, cache_modifier=".cg")
        tl.store(v_cache + cache_at, v, mask=first_row)
        tl.debug_barrier()
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n in range(start, end, ATTN_BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, None, n, seq, None, end, kv_head, qk_scale, 1.0, None, None,
                                     k_cache, v_cache, bt_ptr, None, None, stride_bt, NUM_KV_HEADS, HEAD_DIM, PAGE,
                                     True, ATTN_BLOCK_N, 1, PRECISION, 0, False)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    heads = kv_head * GROUP + g
    head_mask = (g < GROUP)[:, None]
    dst = attn_ptr + seq * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :]
    if splits == 1:
        tl.store(dst, out.to(attn_ptr.dtype.element_ty), mask=head_mask)
        if AMAX:
            _gather_amax(amax_ptr + seq + 0 * g, out.to(attn_ptr.dtype.element_ty), head_mask)
    else:
        parts = (seq * NUM_HEADS + heads) * splits  # [B, NUM_HEADS, splits] rows of HEAD_DIM
        tl.store(part_o_ptr + (parts + split)[:, None] * HEAD_DIM + d[None, :], out, mask=head_mask)
        tl.store(part_lse_ptr + parts + split, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), mask=g < GROUP)
        if _last_arrival(counters + seq * NUM_KV_HEADS + kv_head, splits):
            _merge_splits(part_o_ptr, part_lse_ptr, attn_ptr, amax_ptr, seq, kv_head, splits, NUM_HEADS, GROUP,
                          HEAD_DIM, AMAX)


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, attn_ptr, amax_ptr, seq, kv_head, splits, NUM_HEADS: tl.constexpr,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, AMAX: tl.constexpr):
    """The group's heads from their splits' partials by log-sum-exp (``_merge_kernel``'s), all splits of a head in
    one load; AMAX: their largest |value| into amax_ptr[seq]."""
    s = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    valid = s < splits
    largest = tl.zeros([HEAD_DIM], tl.float32)
    for j in tl.static_range(GROUP):
        head = kv_head * GROUP + j
        rows = (seq * NUM_HEADS + head) * splits + s
        lse = tl.load(part_lse_ptr + rows, mask=valid, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(part_o_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0,
                        cache_modifier=".cg")
        m = tl.max(lse, 0)
        w = tl.where(lse > float("-inf"), tl.math.exp2(lse - m), 0.0)
        out = tl.sum(w[:, None] * parts, 0) / tl.maximum(tl.sum(w, 0), 1e-30)
        tl.store(attn_ptr + seq * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + d, out.to(attn_ptr.dtype.element_ty))
        if AMAX:
            largest = tl.maximum(largest, tl.abs(out.to(attn_ptr.dtype.element_ty).to(tl.float32)))
    if AMAX:
        tl.atomic_max(amax_ptr + seq, tl.max(largest, 0).to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _prefetch_tiles(w_ptr, pid, K: tl.constexpr, N: tl.constexpr, SPLITS: tl.constexpr, GATE_UP: tl.constexpr,
                    NUM_PROGRAMS: tl.constexpr, PREFETCH: tl.constexpr):
    """Asks L2 for the weights of this program's tasks (tile, K split) of a stage over w [N (x2: GATE_UP), K],
    without waiting: issued before a barrier, they arrive while the program waits."""
    if PREFETCH:
        LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements in 128 bytes
        SEGMENT: tl.constexpr = K // SPLITS
        LINES: tl.constexpr = (SEGMENT + LINE - 1) // LINE
        rows = tl.arange(0, _BLOCK_N)
        for t in range(pid, N // _BLOCK_N * SPLITS, NUM_PROGRAMS):
            start = w_ptr + ((t // SPLITS) * _BLOCK_N + rows[:, None]).to(tl.int64) * K + (t % SPLITS) * SEGMENT
            for c in range(0, LINES, 32):
                lines = tl.minimum(c + tl.arange(0, 32), LINES - 1)[None, :] * LINE
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [start + lines],
                                          dtype=tl.int32, is_pure=False, pack=1)
                if GATE_UP:
                    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                              [start + N * K + lines], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["m", "first_layer", "end_layer", "attn_splits"])
def _decode_layers_kernel(r_ptr, qkv_ptr, attn_ptr, act_ptr, part_ptr, part_o_ptr, part_lse_ptr, sync_ptr, amax_ptr,
                          trace_ptr, table_ptr, kv_ptr, cos_sin_ptr, pos_ptr, slot_ptr, ctx_ptr, bt_ptr, m,
                          first_layer, end_layer, attn_splits, eps, qk_scale, stride_layer, stride_kv, stride_bt,
                          HIDDEN: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, INTERMEDIATE: tl.constexpr, BLOCK_K: tl.constexpr,
                          GATE_UP_BLOCK_K: tl.constexpr, O_BLOCK_K: tl.constexpr, DOWN_BLOCK_K: tl.constexpr,
                          O_SPLITS: tl.constexpr, DOWN_SPLITS: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                          BLOCK_G: tl.constexpr, PAGE: tl.constexpr, ATTN_BLOCK_N: tl.constexpr,
                          WINDOW: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr, PREFETCH: tl.constexpr,
                          SPIN_ASM: tl.constexpr, STAGE: tl.constexpr, TRACE: tl.constexpr, FP8: tl.constexpr,
                          SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, ROUND_FP8: tl.constexpr):
    """Layers [first_layer, end_layer) of a decode step on r [m, HIDDEN], the residual stream, in place: every
    stage with a barrier after each (STAGE -1), or only stage STAGE (the CPU tests' launches, no barriers). The
    stages, their tasks and the barrier targets are ``DecodePlan``'s. FP8 (``FP8_MODES``): the projections'
    weights in the residual stream's dtype (0) or e4m3, and how their scales apply: block-wise over SCALE_N x
    SCALE_K blocks, or per channel; per channel, amax_ptr holds [layers, 2 (attention, MLP), _BLOCK_M] row amaxes
    (zeroed per launch)."""
    dtype: tl.constexpr = r_ptr.dtype.element_ty
    W_DTYPE: tl.constexpr = tl.float8e4nv if FP8 > 0 else dtype
    Q: tl.constexpr = NUM_HEADS * HEAD_DIM
    QKV: tl.constexpr = Q + 2 * NUM_KV_HEADS * HEAD_DIM
    PRECISION: tl.constexpr = "ieee" if dtype == tl.float32 else "tf32"
    ALL: tl.constexpr = STAGE < 0
    CHANNEL: tl.constexpr = FP8 == FP8_CHANNEL
    pid = tl.program_id(0)
    counters = sync_ptr + 2
    for layer in range(first_layer, end_layer):
        table = table_ptr + layer * TABLE_WIDTH
        attn_amax = amax_ptr + layer * (2 * _BLOCK_M)
        act_amax = attn_amax + _BLOCK_M
        done = (layer - first_layer) * NUM_STAGES  # stages ended before this layer's
        if ALL or STAGE == 0:
            _mark(trace_ptr, pid, layer, end_layer, 0, 0, TRACE)
            for t in range(pid, QKV // _BLOCK_N, NUM_PROGRAMS):
                _normed_gemv(r_ptr, _ptr(table, 0, dtype), _ptr(table, 1, W_DTYPE), _ptr(table, 9, tl.float32),
                             _ptr(table, 2, dtype), qkv_ptr, act_amax, m, t, eps, HIDDEN, QKV, False, BIAS, BLOCK_K,
                             PRECISION, FP8, SCALE_N, SCALE_K, ROUND_FP8)
            _mark(trace_ptr, pid, layer, end_layer, 0, 1, TRACE)
            _prefetch_tiles(_ptr(table, 5, W_DTYPE), pid, Q, HIDDEN, O_SPLITS, False, NUM_PROGRAMS, PREFETCH)
            if ALL:
                _grid_barrier(sync_ptr, (done + 1) * NUM_PROGRAMS, SPIN_ASM)
            _mark(trace_ptr, pid, layer, end_layer, 0, 2, TRACE)
        if ALL or STAGE == 1:
            _mark(trace_ptr, pid, layer, end_layer, 1, 0, TRACE)
            for t in range(pid, m * NUM_KV_HEADS * attn_splits, NUM_PROGRAMS):
                k_cache = kv_ptr + tl.cast(layer, tl.int64) * stride_layer
                _attention_task(qkv_ptr, attn_ptr, part_o_ptr, part_lse_ptr, counters, attn_amax, k_cache,
                                k_cache + stride_kv, _ptr(table, 3, dtype), _ptr(table, 4, dtype), cos_sin_ptr,
                                pos_ptr, slot_ptr, ctx_ptr, bt_ptr, stride_bt, t, attn_splits, eps, qk_scale,
                                NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_G, PAGE, ATTN_BLOCK_N, WINDOW, NORM,
                                PRECISION, CHANNEL)
            _mark(trace_ptr, pid, layer, end_layer, 1, 1, TRACE)
            if ALL:
                _grid_barrier(sync_ptr, (done + 2) * NUM_PROGRAMS, SPIN_ASM)
            _mark(trace_ptr, pid, layer, end_layer, 1, 2, TRACE)
        if ALL or STAGE == 2:
            _mark(trace_ptr, pid, layer, end_layer, 2, 0, TRACE)
            for t in range(pid, HIDDEN // _BLOCK_N * O_SPLITS, NUM_PROGRAMS):
                _split_gemv_add(attn_ptr, _ptr(table, 5, W_DTYPE), _ptr(table, 10, tl.float32), attn_amax, r_ptr,
                                part_ptr, counters, m, t, Q, HIDDEN, O_SPLITS, O_BLOCK_K, PRECISION, FP8, SCALE_N,
                                SCALE_K, ROUND_FP8)
            _mark(trace_ptr, pid, layer, end_layer, 2, 1, TRACE)
            _prefetch_tiles(_ptr(table, 7, W_DTYPE), pid, HIDDEN, INTERMEDIATE, 1, True, NUM_PROGRAMS, PREFETCH)
            if ALL:
                _grid_barrier(sync_ptr, (done + 3) * NUM_PROGRAMS, SPIN_ASM)
            _mark(trace_ptr, pid, layer, end_layer, 2, 2, TRACE)
        if ALL or STAGE == 3:
            _mark(trace_ptr, pid, layer, end_layer, 3, 0, TRACE)
            w = _ptr(table, 7, W_DTYPE)
            for t in range(pid, INTERMEDIATE // _BLOCK_N, NUM_PROGRAMS):
                _normed_gemv(r_ptr, _ptr(table, 6, dtype), w, _ptr(table, 11, tl.float32), r_ptr, act_ptr, act_amax,
                             m, t, eps, HIDDEN, INTERMEDIATE, True, False, GATE_UP_BLOCK_K, PRECISION, FP8, SCALE_N,
                             SCALE_K, ROUND_FP8)
            _mark(trace_ptr, pid, layer, end_layer, 3, 1, TRACE)
            _prefetch_tiles(_ptr(table, 8, W_DTYPE), pid, INTERMEDIATE, HIDDEN, DOWN_SPLITS, False, NUM_PROGRAMS,
                            PREFETCH)
            if ALL:
                _grid_barrier(sync_ptr, (done + 4) * NUM_PROGRAMS, SPIN_ASM)
            _mark(trace_ptr, pid, layer, end_layer, 3, 2, TRACE)
        if ALL or STAGE == 4:
            _mark(trace_ptr, pid, layer, end_layer, 4, 0, TRACE)
            for t in range(pid, HIDDEN // _BLOCK_N * DOWN_SPLITS, NUM_PROGRAMS):
                _split_gemv_add(act_ptr, _ptr(table, 8, W_DTYPE), _ptr(table, 12, tl.float32), act_amax, r_ptr,
                                part_ptr, counters, m, t, INTERMEDIATE, HIDDEN, DOWN_SPLITS, DOWN_BLOCK_K, PRECISION,
                                FP8, SCALE_N, SCALE_K, ROUND_FP8)
            _mark(trace_ptr, pid, layer, end_layer, 4, 1, TRACE)
            if layer + 1 < end_layer:
                _prefetch_tiles(_ptr(table + TABLE_WIDTH, 1, W_DTYPE), pid, HIDDEN, QKV, 1, False, NUM_PROGRAMS,
                                PREFETCH)
            if ALL and layer + 1 < end_layer:
                _grid_barrier(sync_ptr, (done + 5) * NUM_PROGRAMS, SPIN_ASM)
            _mark(trace_ptr, pid, layer, end_layer, 4, 2, TRACE)


class DecodeScratch:
    """The kernel's buffers between stages, for up to BLOCK_M sequences, and its sync counters; with per-channel
    fp8 weights, after them (zeroed with them) each layer's row amaxes of the activations (``amax``)."""

    def __init__(self, plan: DecodePlan, dtype: torch.dtype, device: torch.device, num_layers: int = 0):
        p, f32 = plan, torch.float32
        self.qkv = torch.zeros(BLOCK_M, p.qkv_size, dtype=dtype, device=device)
        self.attn = torch.zeros(BLOCK_M, p.num_heads * p.head_dim, dtype=dtype, device=device)
        self.act = torch.zeros(BLOCK_M, p.intermediate_size, dtype=dtype, device=device)
        self.part = torch.zeros(max(p.o_splits, p.down_splits), BLOCK_M, p.hidden_size, dtype=f32, device=device)
        splits = p.attention_splits(1)
        self.part_o = torch.zeros(BLOCK_M * p.num_heads * splits, p.head_dim, dtype=f32, device=device)
        self.part_lse = torch.zeros(BLOCK_M * p.num_heads * splits, dtype=f32, device=device)
        counters = p.num_counters(BLOCK_M)
        amax = 2 * BLOCK_M * num_layers if p.fp8 == "channel" else 0
        self.sync = torch.zeros(counters + amax, dtype=torch.int32, device=device)
        self.amax = self.sync[counters:]


def decode_layers(plan: DecodePlan, scratch: DecodeScratch, r: torch.Tensor, table: torch.Tensor,
                  kv_cache: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                  context_lens: torch.Tensor, block_tables: torch.Tensor, *, eps: float, scale: float, window: int = 0,
                  qk_norm: bool, qkv_bias: bool, prefetch: bool = False, spin_asm: bool = False,
                  stages_one_by_one: bool = False, attn_block_n: int = 32, trace: torch.Tensor | None = None,
                  fp8_load_k: int = 0, check_only: bool = False):
    """Runs every layer of ``table`` on r [m <= BLOCK_M, hidden] in place: one launch, or with
    ``stages_one_by_one`` a launch per layer and stage (no barriers). kv_cache is
    [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim], table [num_layers, len(TABLE)] int64 of data
    pointers. ``trace``: int64 [programs, num_layers, stages, 3] for ``_mark``'s timestamps (CUDA only).
    ``fp8_load_k``: with fp8 weights, at most this many K columns a weight load (0: the plan's ``block_k``).
    Returns the compiled kernel; ``check_only`` compiles without launching."""
    m, p, num_layers = r.size(0), plan, table.size(0)
    if fp8_load_k and (fp8_load_k < 16 or fp8_load_k & (fp8_load_k - 1)):
        raise ValueError(f"fp8_load_k {fp8_load_k} is not a power of two >= 16")

    def block_k(stage: str) -> int:
        k = min(p.block_k(stage), fp8_load_k) if p.fp8 and fp8_load_k else p.block_k(stage)
        if p.fp8 == "block" and k % p.weight_block_size[1] and k != p.stage_k(stage):
            raise ValueError(f"the persistent decode kernel quantizes x per fp8 weight block of "
                             f"{p.weight_block_size[1]} columns inside a load of {k} ({stage}): a load must hold "
                             "whole blocks, or all of K")
        return k

    assert 0 < m <= BLOCK_M and r.is_contiguous() and kv_cache.is_contiguous() and table.size(1) == len(TABLE)
    assert p.fp8 != "channel" or scratch.amax.numel() >= 2 * BLOCK_M * num_layers, "DecodeScratch's num_layers"
    scratch.sync.zero_()
    tensors = (r, scratch.qkv, scratch.attn, scratch.act, scratch.part, scratch.part_o, scratch.part_lse,
               scratch.sync, scratch.amax if scratch.amax.numel() else scratch.sync,
               scratch.sync if trace is None else trace, table, kv_cache, cos_sin, positions, slot_mapping,
               context_lens, block_tables, m)
    scalars = (p.attention_splits(m), eps, scale * LOG2E, kv_cache.stride(1), kv_cache.stride(0),
               block_tables.stride(0))
    constants = dict(
        HIDDEN=p.hidden_size, NUM_HEADS=p.num_heads, NUM_KV_HEADS=p.num_kv_heads, HEAD_DIM=p.head_dim,
        INTERMEDIATE=p.intermediate_size, BLOCK_K=block_k("qkv"), GATE_UP_BLOCK_K=block_k("gate_up"),
        O_BLOCK_K=block_k("o_proj"), DOWN_BLOCK_K=block_k("down_proj"), O_SPLITS=p.o_splits,
        DOWN_SPLITS=p.down_splits, NUM_PROGRAMS=p.num_programs,
        BLOCK_G=max(16, triton.next_power_of_2(p.num_heads // p.num_kv_heads)), PAGE=kv_cache.size(3),
        ATTN_BLOCK_N=min(attn_block_n, kv_cache.size(3)), WINDOW=window, NORM=qk_norm, BIAS=qkv_bias,
        PREFETCH=prefetch and not INTERPRET, SPIN_ASM=spin_asm and not INTERPRET, TRACE=trace is not None,
        FP8=FP8_MODES[p.fp8], SCALE_N=(p.weight_block_size or (1, 1))[0], SCALE_K=(p.weight_block_size or (1, 1))[1],
        ROUND_FP8=INTERPRET, num_warps=4, num_stages=2)
    grid = (p.num_programs,)
    launch = functools.partial(_decode_layers_kernel.warmup, grid=grid) if check_only else _decode_layers_kernel[grid]
    launches = [(range(num_layers), -1)] if not stages_one_by_one else [
        (range(layer, layer + 1), stage) for layer in range(num_layers) for stage in range(len(STAGES))]
    for layers, stage in launches:
        compiled = launch(*tensors, layers.start, layers.stop, *scalars, STAGE=stage, **constants)
    return compiled


def resident_programs_per_sm(compiled, device: torch.device) -> int:
    """How many programs of a compiled kernel one SM holds at once (registers, shared memory, warps)."""
    getattr(compiled, "_init_handles", lambda: None)()  # loads the binary: its register count
    props = torch.cuda.get_device_properties(device)
    warps = compiled.metadata.num_warps
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, compiled.n_regs * 32 * warps)
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // max(1, compiled.metadata.shared)
    by_warps = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return min(by_regs, by_smem, by_warps)
