"""Paged attention in Triton with ``reference.py``'s functions and cache layout: the KV store (alone
or fused with q/k norm and rotary), varlen causal prefill, split-KV decode. ``window`` > 0: position
i sees keys (i - window, i]."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels import dot_precision, reference

LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(reference.FP8_MAX)  # kernels may read only constexpr globals
# the interpreter rounds float -> e4m3 without carrying into the exponent (7.9 becomes 4): the
# stores round first
_ROUND_FP8 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    y = x / step  # exact: a power of two
    r = tl.floor(y + 0.5)
    # a tie goes to even
    r = tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)
    return ((r * step).to(tl.int32, bitcast=True)
            | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # -0 too


@triton.jit
def _to_cache(x, inv_scale, cache_ptr, FP8: tl.constexpr, ROUND_FP8: tl.constexpr):
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
        if ROUND_FP8:
            x = _round_to_e4m3(x)
    return x.to(cache_ptr.dtype.element_ty)


# ---- KV store
@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v,
                          inv_k_scale, inv_v_scale, D: tl.constexpr, BLOCK: tl.constexpr,
                          FP8: tl.constexpr, ROUND_FP8: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    k = _to_cache(tl.load(k_ptr + i * stride_k + offs, mask=mask), inv_k_scale, k_cache_ptr, FP8,
                  ROUND_FP8)
    v = _to_cache(tl.load(v_ptr + i * stride_v + offs, mask=mask), inv_v_scale, v_cache_ptr, FP8,
                  ROUND_FP8)
    tl.store(k_cache_ptr + slot * D + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * D + offs, v, mask=mask)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes k, v [N, num_kv_heads, head_dim] at slot_mapping [N]; slot -1 is skipped."""
    n, num_kv_heads, head_dim = k.shape
    d = num_kv_heads * head_dim
    assert k.stride(-1) == v.stride(-1) == 1 and k.stride(1) == v.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.numel() == n
    if n:
        _store_kvcache_kernel[(n,)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), 1.0 / k_scale,
            1.0 / v_scale, D=d, BLOCK=triton.next_power_of_2(d), FP8=is_fp8(k_cache),
            ROUND_FP8=_ROUND_FP8)


@triton.jit
def _qk_norm_rope_store_kernel(qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
                               slot_ptr, k_cache_ptr, v_cache_ptr, stride_t, eps, inv_k_scale,
                               inv_v_scale, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                               HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_KV: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr,
                               ROUND_FP8: tl.constexpr):
    """One token, its q and k heads the rows of one tile; rounds where the unfused ops round."""
    i = tl.program_id(0)
    HALF: tl.constexpr = HEAD_DIM // 2
    rows = tl.arange(0, BLOCK_H)  # q heads, then k heads
    cols = tl.arange(0, HALF)
    mask = (rows < NUM_HEADS + NUM_KV_HEADS)[:, None]
    ptr = qkv_ptr + i.to(tl.int64) * stride_t + rows[:, None] * HEAD_DIM + cols[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    if NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / HEAD_DIM + eps)[:, None]
        is_q = (rows < NUM_HEADS)[:, None]
        w1 = tl.where(is_q, tl.load(q_weight_ptr + cols)[None, :],
                      tl.load(k_weight_ptr + cols)[None, :])
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + cols)[None, :],
                      tl.load(k_weight_ptr + HALF + cols)[None, :])
        x1 = (w1.to(tl.float32) * (f1 * rstd).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2.to(tl.float32) * (f2 * rstd).to(dtype).to(tl.float32)).to(dtype)
    pos = tl.load(positions_ptr + i).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + cols).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + cols).to(tl.float32)[None, :]
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (f1 * cos - f2 * sin).to(dtype)
    o2 = (f2 * cos + f1 * sin).to(dtype)
    tl.store(ptr, o1, mask=mask)
    tl.store(ptr + HALF, o2, mask=mask)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot >= 0:
        kv_row = rows[:, None] - NUM_HEADS
        k_mask = mask & (kv_row >= 0)
        k_ptr = k_cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + kv_row * HEAD_DIM + cols[None, :]
        tl.store(k_ptr, _to_cache(o1, inv_k_scale, k_cache_ptr, FP8, ROUND_FP8), mask=k_mask)
        tl.store(k_ptr + HALF, _to_cache(o2, inv_k_scale, k_cache_ptr, FP8, ROUND_FP8), mask=k_mask)
        vr = tl.arange(0, BLOCK_KV)[:, None]
        d = tl.arange(0, HEAD_DIM)[None, :]
        v_mask = vr < NUM_KV_HEADS
        v = tl.load(qkv_ptr + i.to(tl.int64) * stride_t
                    + (NUM_HEADS + NUM_KV_HEADS + vr) * HEAD_DIM + d, mask=v_mask)
        tl.store(v_cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + vr * HEAD_DIM + d,
                 _to_cache(v, inv_v_scale, v_cache_ptr, FP8, ROUND_FP8), mask=v_mask)


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int, k_scale: float = 1.0,
                       v_scale: float = 1.0):
    """q/k ``RMSNorm`` (unless the weights are None), ``RotaryEmbedding`` and ``store_kvcache`` in
    one launch, in place on qkv [N, (num_heads + 2 * num_kv_heads) * head_dim]; returns its q, k, v
    views."""
    n = qkv.size(0)
    assert head_dim & (head_dim - 1) == 0 and qkv.stride(-1) == 1 and cos_sin_cache.is_contiguous()
    assert qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim
    norm = q_weight is not None
    if n:
        _qk_norm_rope_store_kernel[(n,)](
            qkv, positions, cos_sin_cache, q_weight if norm else qkv, k_weight if norm else qkv,
            slot_mapping, k_cache, v_cache, qkv.stride(0), eps, 1.0 / k_scale, 1.0 / v_scale,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads),
            BLOCK_KV=triton.next_power_of_2(num_kv_heads), NORM=norm, FP8=is_fp8(k_cache),
            ROUND_FP8=_ROUND_FP8)
    return qkv.view(n, num_heads + 2 * num_kv_heads, head_dim).split(
        [num_heads, num_kv_heads, num_kv_heads], dim=1)


# ---- prefill (its key tile also serves decode)
@triton.jit
def _attend_tile(acc, l_i, m_i, q, q_pos, start, seq, q_start, k_len, kv_head, qk_scale, v_scale,
                 k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, stride_kt, stride_vt, stride_bt,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                 PAGED: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                 PRECISION: tl.constexpr, WINDOW: tl.constexpr, SCALE_V: tl.constexpr):
    """One key tile [start, start + BLOCK_N) of the online softmax. MASK: 0 none, 1 keys from k_len
    on, 2 also the causal diagonal and outside WINDOW. Cached tiles convert to q's dtype (fp16 for
    fp8: cheaper); SCALE_V's multiply also keeps Triton from converting V after its layout shuffle
    (bytewise through shared memory)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = offs_n < k_len
    if PAGED:
        page = tl.load(bt_ptr + seq * stride_bt + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
        kv_off = ((page * PAGE + offs_n % PAGE)[:, None] * (NUM_KV_HEADS * HEAD_DIM)
                  + kv_head * HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_off + offs_d[None, :], mask=valid[:, None],
                    other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off + offs_d[None, :], mask=valid[:, None],
                    other=0.0).to(q.dtype)
        if SCALE_V:
            v = v * tl.cast(v_scale, q.dtype)
    else:  # the new tokens
        rows = (q_start + offs_n)[:, None].to(tl.int64)
        k = tl.load(k_ptr + rows * stride_kt + kv_head * HEAD_DIM + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + rows * stride_vt + kv_head * HEAD_DIM + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASK == 1:
        s = tl.where(valid[None, :], s, float("-inf"))
    if MASK == 2:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < k_len)
        if WINDOW > 0:
            visible &= offs_n[None, :] > q_pos[:, None] - WINDOW
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_exp = m_new
    if WINDOW > 0:  # a row may see no key yet: p and alpha 0, not NaN; m stays -inf
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_exp[:, None])
    alpha = tl.math.exp2(m_i - m_exp)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, o_ptr, cu_q_ptr, cu_k_ptr,
                    bt_ptr, qk_scale, v_scale, stride_qt, stride_qh, stride_kt, stride_vt,
                    stride_ot, stride_oh, stride_bt, GROUP: tl.constexpr,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    PAGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, WINDOW: tl.constexpr, FP8: tl.constexpr,
                    Q_FP16: tl.constexpr):
    m_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_len = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    offs_d = tl.arange(0, HEAD_DIM)
    q_pos = k_len - q_len + offs_m  # its position among the keys
    q = tl.load(q_ptr + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + head * stride_qh
                + offs_d[None, :], mask=(offs_m < q_len)[:, None], other=0.0)
    if Q_FP16:
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    first_q_pos = k_len - q_len + m_block * BLOCK_M
    masked_start = (first_q_pos // BLOCK_N) * BLOCK_N  # keys before it are visible to every row
    if WINDOW > 0:  # all masked, from the tile of the first row's first visible key
        masked_start = tl.maximum(first_q_pos - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    end = tl.minimum(k_len, first_q_pos + BLOCK_M)
    for masked in tl.static_range(1 if WINDOW > 0 else 0, 2):  # the unmasked tiles, then the masked
        for start in range(masked_start if masked else 0, end if masked else masked_start, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start, seq, q_start, k_len, kv_head, qk_scale, v_scale,
                k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, stride_kt, stride_vt, stride_bt,
                NUM_KV_HEADS, HEAD_DIM, PAGE, PAGED, BLOCK_N, 2 * masked, PRECISION, WINDOW, FP8)
    out = acc / l_i[:, None]
    tl.store(o_ptr + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + head * stride_oh
             + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])


def _prefill_config(head_dim: int, dtype: torch.dtype, max_seqlen_q: int, paged: bool) -> dict:
    # tools/bench_kernels.py --sweep's choice; short unpaged prompts: more programs,
    # less causal waste
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if paged or max_seqlen_q >= 2048:
        return dict(BLOCK_M=128, BLOCK_N=128 if head_dim <= 128 else 64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, block_tables: torch.Tensor | None, scale: float,
                      k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0,
                      config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.prefill_attention``; ``config``: the tiles, ``out``: the output buffer."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.size(1)
    paged = block_tables is not None
    cfg = config or _prefill_config(head_dim, q.dtype, max_seqlen_q, paged)
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    bt = block_tables if paged else cu_seqlens_q  # not read unpaged
    fp8 = paged and is_fp8(k_cache)
    if not fp8:
        k_scale = v_scale = 1.0
    grid = (triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), cu_seqlens_q.numel() - 1, num_heads)
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_k, bt, scale * k_scale * LOG2E,
        v_scale, q.stride(0), q.stride(1), k.stride(0), v.stride(0), out.stride(0), out.stride(1),
        bt.stride(0), GROUP=num_heads // num_kv_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        PAGE=k_cache.size(1) if paged else 1, PAGED=paged, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], PRECISION=dot_precision(q.dtype), WINDOW=window, FP8=fp8,
        Q_FP16=fp8 and q.dtype != torch.float32, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out


# ---- decode: a KV head's query heads share one tl.dot (each K/V tile read once);
# splits merge by log-sum-exp
@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, o_ptr, part_o_ptr,
                   part_lse_ptr, qk_scale, v_scale, stride_qb, stride_qh, stride_bt, stride_ob,
                   stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                   WINDOW: tl.constexpr, FP8: tl.constexpr, Q_FP16: tl.constexpr):
    _decode_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, k_cache_ptr,
                    v_cache_ptr, bt_ptr, ctx_ptr, ctx_ptr, o_ptr, part_o_ptr, part_lse_ptr,
                    qk_scale, v_scale, stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
                    GROUP, BLOCK_G, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, NUM_SPLITS, PRECISION,
                    WINDOW, FP8, Q_FP16, 0)


@triton.jit
def _decode_program(seq, kv_head, split, q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr,
                    start_ptr, o_ptr, part_o_ptr, part_lse_ptr, qk_scale, v_scale, stride_qb,
                    stride_qh, stride_bt, stride_ob, stride_oh, GROUP: tl.constexpr,
                    BLOCK_G: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    PRECISION: tl.constexpr, WINDOW: tl.constexpr, FP8: tl.constexpr,
                    Q_FP16: tl.constexpr, PREFIX_PARTS: tl.constexpr):
    """Row ``seq``'s keys of ``kv_head``, the ``split``-th of NUM_SPLITS ranges. PREFIX_PARTS > 0
    (the cascade): keys from start[seq] on (a shared prefix before it is attended apart),
    partials always, NUM_SPLITS + PREFIX_PARTS of them a row (the prefix's last)."""
    ctx = tl.load(ctx_ptr + seq)
    first = 0  # the first visible key
    if WINDOW > 0:
        first = tl.maximum(ctx - WINDOW, 0)
    if PREFIX_PARTS > 0:
        first = tl.load(start_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, ctx)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g  # the query heads of this KV head
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None], other=0.0)
    if Q_FP16:
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n in range(start, end, BLOCK_N):  # masked from the end of this split on
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, None, n, seq, None, end, kv_head, qk_scale,
                                     v_scale, None, None, k_cache_ptr, v_cache_ptr, bt_ptr, None,
                                     None, stride_bt, NUM_KV_HEADS, HEAD_DIM, PAGE, True, BLOCK_N,
                                     1, PRECISION, 0, FP8)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty range (context 0) gives 0
    store_mask = (offs_g < GROUP)[:, None]
    if NUM_SPLITS == 1 and PREFIX_PARTS == 0:
        tl.store(o_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=store_mask)
    else:
        # fp32 partials [B, H, NUM_PARTS, HEAD_DIM] and their log2-sum-exp [B, H, NUM_PARTS]
        row = (seq * (NUM_KV_HEADS * GROUP) + heads) * (NUM_SPLITS + PREFIX_PARTS) + split
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=store_mask)
        tl.store(part_lse_ptr + row, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)),
                 mask=offs_g < GROUP)


@triton.jit
def _merge_kernel(part_o_ptr, part_lse_ptr, start_ptr, o_ptr, stride_ob, stride_oh,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  PREFIX_PARTS: tl.constexpr, BLOCK_S: tl.constexpr):
    """The row's NUM_SPLITS parts by their log2-sum-exp; the last PREFIX_PARTS (a shared prefix's)
    only where the row has one (start[seq] > 0: else unwritten)."""
    seq, head = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    row = (seq * NUM_HEADS + head) * NUM_SPLITS
    num_parts = NUM_SPLITS
    if PREFIX_PARTS > 0:
        num_parts = tl.where(tl.load(start_ptr + seq) > 0, NUM_SPLITS, NUM_SPLITS - PREFIX_PARTS)
    lse = tl.load(part_lse_ptr + row + offs_s, mask=offs_s < num_parts, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.math.exp2(lse - m), 0.0)
    # a part with no keys (lse -inf) may be unwritten: not read
    parts = tl.load(part_o_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=((offs_s < num_parts) & (lse > float("-inf")))[:, None], other=0.0)
    out = tl.sum(w[:, None] * parts, 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(o_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty))


@triton.jit
def _cascade_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, start_ptr, first_row_ptr,
                    num_rows_ptr, shared_ptr, part_o_ptr, part_lse_ptr, qk_scale, v_scale,
                    stride_qb, stride_qh, stride_bt, num_groups, prefix_programs,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, PREFIX_BLOCK_N: tl.constexpr,
                    PREFIX_PARTS: tl.constexpr, GROUPS_P2: tl.constexpr,
                    PRECISION: tl.constexpr, FP8: tl.constexpr, Q_FP16: tl.constexpr):
    """Cascade decode attention's two kinds of programs in one launch (the shared prefixes' tiles,
    on the tensor cores, run beside the rows' own keys, bound by memory; measured faster than two
    launches at every point tried): the first ``prefix_programs`` are ``_shared_prefix_program``'s
    (tile, KV head, part), the rest ``_decode_program``'s (row, KV head, split) over each row's
    keys past its shared prefix. The groups' (tile, KV head, part) triples are counted here, from
    num_rows, and dealt out over the ``prefix_programs`` in turn: a CUDA graph's grid, sized for any
    groups of its batch, launches no program per empty tile."""
    pid = tl.program_id(0)
    if pid < prefix_programs:
        offs_g = tl.arange(0, GROUPS_P2)
        group_tiles = tl.cdiv(tl.load(num_rows_ptr + offs_g, mask=offs_g < num_groups, other=0)
                              * GROUP, BLOCK_M)
        tiles_end = tl.cumsum(group_tiles, 0)
        triples = tl.sum(group_tiles, 0) * NUM_KV_HEADS * PREFIX_PARTS
        for t in range(pid, triples, prefix_programs):
            _shared_prefix_program(
                t // (NUM_KV_HEADS * PREFIX_PARTS), t // PREFIX_PARTS % NUM_KV_HEADS,
                t % PREFIX_PARTS, tiles_end, group_tiles, q_ptr, k_cache_ptr, v_cache_ptr,
                bt_ptr, first_row_ptr, num_rows_ptr, shared_ptr, part_o_ptr, part_lse_ptr,
                qk_scale, v_scale, stride_qb, stride_qh, stride_bt, GROUP, NUM_KV_HEADS,
                HEAD_DIM, PAGE, BLOCK_M, PREFIX_BLOCK_N, NUM_SPLITS + PREFIX_PARTS, PREFIX_PARTS,
                GROUPS_P2, PRECISION, FP8, Q_FP16)
    else:
        pid -= prefix_programs
        _decode_program(
            pid // (NUM_KV_HEADS * NUM_SPLITS), pid // NUM_SPLITS % NUM_KV_HEADS,
            pid % NUM_SPLITS, q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, start_ptr,
            part_o_ptr, part_o_ptr, part_lse_ptr, qk_scale, v_scale, stride_qb, stride_qh,
            stride_bt, 0, 0, GROUP, BLOCK_G, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, NUM_SPLITS,
            PRECISION, 0, FP8, Q_FP16, PREFIX_PARTS)


@triton.jit
def _shared_prefix_program(tile, kv_head, part, tiles_end, group_tiles, q_ptr, k_cache_ptr,
                           v_cache_ptr, bt_ptr, first_row_ptr, num_rows_ptr, shared_ptr,
                           part_o_ptr, part_lse_ptr, qk_scale, v_scale, stride_qb, stride_qh,
                           stride_bt, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                           HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, NUM_PARTS: tl.constexpr,
                           PREFIX_PARTS: tl.constexpr, GROUPS_P2: tl.constexpr,
                           PRECISION: tl.constexpr, FP8: tl.constexpr, Q_FP16: tl.constexpr):
    """Tile ``tile`` (below the last) of the groups' tiles (each group's (row, query head) pairs of
    a KV head in tiles of BLOCK_M, ``group_tiles`` a group, ending at ``tiles_end``: the groups'
    tiles one after another) against its group's shared keys (the group's first row's first
    shared[g] tokens), the ``part``-th of PREFIX_PARTS ranges of them: each pair's partial output
    and log2-sum-exp into part NUM_PARTS - PREFIX_PARTS + part (an empty range: -inf)."""
    offs_g = tl.arange(0, GROUPS_P2)
    g = tl.sum((tiles_end <= tile).to(tl.int32), 0)  # the group whose tiles hold this one
    m_tile = tile - tl.sum(tl.where(offs_g == g, tiles_end - group_tiles, 0), 0)
    first_row = tl.load(first_row_ptr + g)
    pairs = tl.load(num_rows_ptr + g) * GROUP
    shared = tl.load(shared_ptr + g)
    per_part = tl.cdiv(tl.cdiv(shared, PREFIX_PARTS), BLOCK_N) * BLOCK_N
    start = part * per_part
    end = tl.minimum(start + per_part, shared)
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = offs_m < pairs
    seq = first_row + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    q = tl.load(q_ptr + seq.to(tl.int64)[:, None] * stride_qb + head[:, None] * stride_qh
                + offs_d[None, :], mask=valid[:, None], other=0.0)
    if Q_FP16:
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n in range(start, end, BLOCK_N):  # masked from ``end`` on
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, None, n, first_row, None, end,
                                     kv_head, qk_scale, v_scale, None, None, k_cache_ptr,
                                     v_cache_ptr, bt_ptr, None, None, stride_bt, NUM_KV_HEADS,
                                     HEAD_DIM, PAGE, True, BLOCK_N, 1, PRECISION, 0, FP8)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    row = (seq * (NUM_KV_HEADS * GROUP) + head) * NUM_PARTS + NUM_PARTS - PREFIX_PARTS + part
    tl.store(part_o_ptr + row.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=valid[:, None])
    tl.store(part_lse_ptr + row, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), mask=valid)


_PROPERTIES: dict[int, object] = {}


def device_properties(device: torch.device):
    """The CUDA device's properties, read once (kernels' launches ask on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROPERTIES:
        _PROPERTIES[index] = torch.cuda.get_device_properties(index)
    return _PROPERTIES[index]


def num_sms(device: torch.device) -> int:
    return device_properties(device).multi_processor_count


def num_decode_splits(batch: int, num_kv_heads: int, device: torch.device,
                      max_splits: int = 32) -> int:
    """About two waves of programs over the SMs; depends on the batch only, so a captured graph's
    grid is fixed."""
    if device.type != "cuda":
        return 1 if batch * num_kv_heads >= 8 else 2  # the interpreter: still exercise the merge
    return max(1, min(max_splits, triton.cdiv(2 * num_sms(device), batch * num_kv_heads)))


def num_prefix_parts(programs: int, device: torch.device, max_parts: int = 16) -> int:
    """Ranges of a shared prefix's keys that the cascade attends apart: with ``programs`` (tiles x
    KV heads) a group, about two waves over the SMs; 2 in the interpreter (to exercise them)."""
    if device.type != "cuda":
        return 2
    return max(1, min(max_parts, triton.cdiv(2 * num_sms(device), programs)))


def max_prefix_programs(device: torch.device) -> int:
    """The most programs the cascade's shared prefixes get (more (tile, KV head, part) triples:
    some programs take several): 4 a SM, above ``num_prefix_parts``'s ~2 when the groups' tiles
    are few; 4 in the interpreter (to exercise the loop)."""
    return 4 * num_sms(device) if device.type == "cuda" else 4


def _decode_config(dtype: torch.dtype, batch: int) -> dict:
    # tools/bench_kernels.py --sweep's choice
    if dtype == torch.float32:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N=128 if batch >= 256 else 64, num_warps=4, num_stages=3)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0,
                     num_splits: int | None = None, config: dict | None = None,
                     out: torch.Tensor | None = None, prefixes=None,
                     prefix_parts: int | None = None) -> torch.Tensor:
    """``reference.decode_attention``; ``num_splits`` defaults to ``num_decode_splits``'s,
    ``config``: the tiles. ``prefixes`` (``cascade_reference.SharedPrefixes``): the cascade, each
    group's shared blocks read once for all its rows (``_shared_prefix_program``), the rest of each
    context as before from the row's ``seq_shared_len`` on, the parts merged by log-sum-exp;
    ``prefix_parts``: the ranges each group's shared keys are split into (default
    ``num_prefix_parts``'s). Both parts run in one launch (``_cascade_kernel``)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.size(2), k_cache.size(1)
    group = num_heads // num_kv_heads
    fp8 = is_fp8(k_cache)
    cfg = config or _decode_config(q.dtype, batch)
    splits = num_splits or num_decode_splits(batch, num_kv_heads, q.device)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    if not fp8:
        k_scale = v_scale = 1.0
    cascade = prefixes is not None
    if cascade and window:
        raise ValueError(f"cascade decode attention takes no sliding window (window={window})")
    if cascade:  # the groups' tiles of (row, head) pairs (at most one partial tile a group), each
        # against its group's keys in prefix_parts ranges; a group has 2 rows or more (a graph's
        # empty slots none), so at most batch // 2 groups hold a partial tile
        num_groups = prefixes.first_row.numel()
        pcfg = _shared_prefix_config(prefixes.max_rows * group, q.dtype)
        tiles = (min(batch, num_groups * prefixes.max_rows) * group // pcfg["BLOCK_M"]
                 + min(num_groups, batch // 2))
        prefix_parts = prefix_parts or num_prefix_parts(
            triton.cdiv(batch * group, pcfg["BLOCK_M"]) * num_kv_heads, q.device)
        prefix_programs = min(tiles * num_kv_heads * prefix_parts, max_prefix_programs(q.device))
    parts = splits + (prefix_parts if cascade else 0)
    if parts > 1:
        part_o = torch.empty(batch, num_heads, parts, head_dim, dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(batch, num_heads, parts, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # not written
    qk_scale = scale * k_scale * LOG2E
    if cascade:
        _cascade_kernel[(prefix_programs + batch * num_kv_heads * splits,)](
            q, k_cache, v_cache, block_tables, context_lens, prefixes.seq_shared_len,
            prefixes.first_row, prefixes.num_rows, prefixes.shared_len, part_o, part_lse,
            qk_scale, v_scale, q.stride(0), q.stride(1), block_tables.stride(0), num_groups,
            prefix_programs, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=page,
            BLOCK_N=min(cfg["BLOCK_N"], pcfg["BLOCK_N"]), NUM_SPLITS=splits,
            BLOCK_M=pcfg["BLOCK_M"], PREFIX_BLOCK_N=pcfg["BLOCK_N"], PREFIX_PARTS=prefix_parts,
            GROUPS_P2=triton.next_power_of_2(max(num_groups, 1)),
            PRECISION=dot_precision(q.dtype), FP8=fp8, Q_FP16=fp8 and q.dtype != torch.float32,
            num_warps=pcfg["num_warps"], num_stages=pcfg["num_stages"])
    else:
        _decode_kernel[(batch, num_kv_heads, splits)](
            q, k_cache, v_cache, block_tables, context_lens, out, part_o, part_lse, qk_scale,
            v_scale, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0),
            out.stride(1), GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=page, BLOCK_N=cfg["BLOCK_N"],
            NUM_SPLITS=splits, PRECISION=dot_precision(q.dtype), WINDOW=window, FP8=fp8,
            Q_FP16=fp8 and q.dtype != torch.float32, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
    if parts > 1:
        _merge_kernel[(batch, num_heads)](
            part_o, part_lse, prefixes.seq_shared_len if cascade else context_lens, out,
            out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            NUM_SPLITS=parts, PREFIX_PARTS=parts - splits, BLOCK_S=triton.next_power_of_2(parts))
    return out


def _shared_prefix_config(pairs: int, dtype: torch.dtype) -> dict:
    """Rows of (sequence, query head) pairs a tile: as many as a group has, 16 to 64 (not yet swept
    on a GPU)."""
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=min(64, max(16, triton.next_power_of_2(pairs))), BLOCK_N=64, num_warps=4,
                num_stages=3)
