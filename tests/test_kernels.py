"""Attention and dense-layer kernels against the PyTorch reference (computed in float64) on fresh
random inputs.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (set in conftest) at small shapes, in
fp32 and fp16 (the interpreter's bf16 matmul is wrong, so bf16 is checked on the GPU); with a
GPU the same tests run compiled, plus bf16 and flash-attn. Outputs are poisoned with NaN first,
so an unwritten element fails.
"""
from __future__ import annotations

import functools
import importlib.util
import random

import pytest
import torch

from nanovllm.kernels import reference

triton_attention = pytest.importorskip("nanovllm.kernels.triton_attention")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN output"
    return float((out.double() - ref).norm() / ref.norm())


def paged_cache(num_seqs_tokens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                dtype, seed: int):
    """Random K/V for sequences of the given lengths scattered over shuffled blocks of a cache.
    Returns the caches, the block tables ([-1]-padded) and each sequence's K/V."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in num_seqs_tokens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    tables, used = [], 0
    for nb in blocks_per_seq:
        tables.append(order[used:used + nb])
        used += nb
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE)


def test_store_kvcache():
    for dtype in DTYPES:
        n, kvh, d = 7, 2, 64
        qkv = torch.randn(n, (4 + 2 * kvh) * d, device=DEVICE).to(dtype)
        k = qkv[:, 4 * d:(4 + kvh) * d].view(n, kvh, d)  # strided views, as the model makes them
        v = qkv[:, (4 + kvh) * d:].view(n, kvh, d)
        k_cache = torch.full((4, 4, kvh, d), 123.0, device=DEVICE, dtype=dtype)
        v_cache = torch.full((4, 4, kvh, d), 123.0, device=DEVICE, dtype=dtype)
        slots = torch.tensor([3, -1, 0, 15, 8, -1, 9], dtype=torch.int32, device=DEVICE)
        triton_attention.store_kvcache(k, v, k_cache, v_cache, slots)
        flat_k, flat_v = k_cache.view(16, kvh, d), v_cache.view(16, kvh, d)
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                assert torch.equal(flat_k[s], k[i]) and torch.equal(flat_v[s], v[i])
        untouched = [s for s in range(16) if s not in slots.tolist()]
        assert (flat_k[untouched] == 123).all() and (flat_v[untouched] == 123).all()


def test_store_kvcache_skips_padding():
    k_cache = torch.zeros(3, 2, 1, 4)
    v_cache = torch.zeros(3, 2, 1, 4)
    k = torch.randn(3, 1, 4)
    reference.store_kvcache(k, -k, k_cache, v_cache, torch.tensor([5, -1, 0], dtype=torch.int32))
    flat = k_cache.view(6, 1, 4)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[0], k[2])
    assert flat[1:5].abs().sum() == 0 and torch.equal(v_cache.view(6, 1, 4)[5], -k[0])
    # a first row to skip leaves slot 0 (a live block's) alone; all rows skipped write nothing that
    # matters
    k_cache.fill_(7.0)
    reference.store_kvcache(k, -k, k_cache, v_cache, torch.tensor([-1, 3, -1], dtype=torch.int32))
    assert torch.equal(flat[3], k[1]) and (flat[[0, 1, 2, 4, 5]] == 7.0).all()
    reference.store_kvcache(k, -k, k_cache[:1], v_cache[:1],
                            torch.full((3,), -1, dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,norm", [((4, 2, 64), True), ((6, 3, 32), True),
                                        ((8, 8, 128), False)],
                         ids=["H4-KV2-D64-norm", "H6-KV3-D32-norm", "H8-KV8-D128-rope-only"])
def test_qk_norm_rope_store_matches_separate_ops(heads, norm, dtype):
    """The fused prologue equals the separate ops it replaces (RMSNorm per head, rotary, KV store):
    fp16 to the last bit on CPU; otherwise within a rounding step of the dtype (the sum of squares
    is reduced in another order, and the GPU contracts fp32 multiply-adds)."""
    from nanovllm.layers.layernorm import RMSNorm
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    num_heads, num_kv_heads, d = heads
    n, num_slots = 9, 32
    g = torch.Generator().manual_seed(d + num_heads)
    qkv = (torch.randn(n, (num_heads + 2 * num_kv_heads) * d, generator=g) * 3).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 5, 17, 3, 99, 1, 63, 64, 2], device=DEVICE)
    slots = torch.tensor([3, -1, 0, 31, 8, -1, 9, 12, 20], dtype=torch.int32, device=DEVICE)
    rope = RotaryEmbedding(d, 128, 10000.0).to(DEVICE)
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    with torch.no_grad():
        for m in (q_norm, k_norm):
            m.weight.copy_(torch.rand(d, generator=g) + 0.5)
    q_norm, k_norm = q_norm.to(DEVICE, dtype), k_norm.to(DEVICE, dtype)

    # the separate ops, as DecoderAttention runs them without the fused kernel
    q, k, v = qkv.clone().split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k, v = (q.reshape(n, num_heads, d), k.reshape(n, num_kv_heads, d),
               v.reshape(n, num_kv_heads, d))
    if norm:
        q, k = q_norm(q), k_norm(k)
    ref_q, ref_k = rope(positions, q, k)
    ref_kc = torch.full((num_slots, num_kv_heads, d), 7.0, device=DEVICE, dtype=dtype)
    ref_vc = ref_kc.clone()
    reference.store_kvcache(ref_k, v, ref_kc.view(8, 4, num_kv_heads, d),
                            ref_vc.view(8, 4, num_kv_heads, d), slots)

    k_cache = torch.full((8, 4, num_kv_heads, d), 7.0, device=DEVICE, dtype=dtype)
    v_cache = k_cache.clone()
    out_q, out_k, out_v = triton_attention.qk_norm_rope_store(
        qkv, positions, rope.cos_sin_cache, q_norm.weight if norm else None,
        k_norm.weight if norm else None, 1e-6, k_cache, v_cache, slots, num_heads, num_kv_heads, d)
    # a rounding step at the normalized values' magnitude (up to ~4): the GPU's rsqrt may round
    # differently
    ulp = {torch.float32: 1e-5, torch.float16: 4e-3 if CUDA else 0, torch.bfloat16: 3.2e-2}[dtype]
    for got, want in ((out_q, ref_q), (out_k, ref_k), (out_v, v),
                      (k_cache.view(num_slots, num_kv_heads, d), ref_kc),
                      (v_cache.view(num_slots, num_kv_heads, d), ref_vc)):
        torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp)
    assert out_q.data_ptr() == qkv.data_ptr()  # in place: q, k, v are views of qkv

    # without norm weights it is the rotary alone; slots of -1 (the warmup forward) store nothing
    raw = torch.randn(n, (num_heads + 2 * num_kv_heads) * d, generator=g).to(dtype).to(DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q2, k2, v2 = triton_attention.qk_norm_rope_store(raw.clone(), positions, rope.cos_sin_cache,
                                                     None, None, 0.0, k_cache, v_cache,
                                                     torch.full_like(slots, -1), num_heads,
                                                     num_kv_heads, d)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    want_q, want_k = rope(positions, raw[:, :num_heads * d].reshape(n, num_heads, d),
                          raw[:, num_heads * d:(num_heads + num_kv_heads) * d]
                          .reshape(n, num_kv_heads, d))
    torch.testing.assert_close(q2.float(), want_q.float(), rtol=ulp, atol=ulp)
    torch.testing.assert_close(k2.float(), want_k.float(), rtol=ulp, atol=ulp)
    assert torch.equal(v2.reshape(n, -1), raw[:, (num_heads + num_kv_heads) * d:])


DECODE_CASES = [  # (num_heads, num_kv_heads, head_dim, block_size, context lengths, num_splits)
    (4, 4, 64, 16, [1, 17, 40], 1),
    (8, 4, 128, 16, [5, 33, 1, 64], 3),
    (8, 2, 64, 32, [70, 2], 2),
    (16, 2, 128, 16, [31, 48, 16], 1),
    (8, 1, 64, 16, [100, 9], 4),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: f"H{c[0]}-KV{c[1]}-D{c[2]}-B{c[3]}-S{c[5]}")
def test_decode_attention(case, dtype):
    num_heads, num_kv_heads, head_dim, block_size, lens, splits = case
    k_cache, v_cache, block_tables = paged_cache(lens, num_kv_heads, head_dim, block_size, dtype,
                                                 seed=len(lens))
    q = torch.randn(len(lens), num_heads, head_dim, device=DEVICE).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), ctx,
                                     block_tables, scale)
    out = torch.full_like(q, float("nan"))
    triton_attention.decode_attention(q, k_cache, v_cache, ctx, block_tables, scale,
                                      num_splits=splits, out=out)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_context_zero_rows_are_finite():
    """CUDA Graph padding rows have context 0: their output must not be NaN."""
    k_cache, v_cache, block_tables = paged_cache([20, 20], 2, 64, 16, torch.float32, seed=3)
    q = torch.randn(2, 4, 64, device=DEVICE)
    ctx = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out = triton_attention.decode_attention(q, k_cache, v_cache, ctx, block_tables, 0.125,
                                                num_splits=splits)
        assert torch.isfinite(out).all()


PREFILL_CASES = [  # (num_heads, num_kv_heads, head_dim, block_size, [(cached, new) per sequence])
    (4, 4, 64, 16, [(0, 5), (0, 40), (0, 1)]),
    (8, 4, 128, 16, [(0, 33), (0, 17)]),
    (8, 2, 64, 32, [(32, 20), (0, 45), (64, 1)]),
    (8, 1, 128, 16, [(16, 50), (48, 3)]),
    (16, 2, 64, 16, [(5, 70)]),   # a chunked prefill: the cached part ends mid-block
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES,
                         ids=lambda c: f"H{c[0]}-KV{c[1]}-D{c[2]}-B{c[3]}-{c[4]}")
def test_prefill_attention(case, dtype):
    num_heads, num_kv_heads, head_dim, block_size, seqs = case
    paged = any(cached for cached, _ in seqs)
    lens_k = [c + n for c, n in seqs]
    k_cache, v_cache, block_tables = paged_cache(lens_k, num_kv_heads, head_dim, block_size, dtype,
                                                 seed=len(seqs))
    num_new = sum(n for _, n in seqs)
    q = torch.randn(num_new, num_heads, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(num_new, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(num_new, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    cu_q = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))],
                        dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(lens_k[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    cu_q, cu_k = cu_q.to(DEVICE), cu_k.to(DEVICE)
    if paged:  # the new tokens' K/V go into the cache first, as the attention layer does
        slots = [block_tables[i, p // block_size].item() * block_size + p % block_size
                 for i, (c, n) in enumerate(seqs) for p in range(c, c + n)]
        reference.store_kvcache(k, v, k_cache, v_cache,
                                torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    tables = block_tables if paged else None
    scale = head_dim ** -0.5
    max_q = max(n for _, n in seqs)
    ref = reference.prefill_attention(q.double(), k.double(), v.double(), k_cache.double(),
                                      v_cache.double(), cu_q, cu_k, max_q, tables, scale)
    out = torch.full_like(q, float("nan"))
    triton_attention.prefill_attention(q, k, v, k_cache, v_cache, cu_q, cu_k, max_q, tables, scale,
                                       out=out)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                    reason="flash-attn is not installed")
@pytest.mark.parametrize("window", [0, 100])
def test_flash_attn_backend_sliding_window_matches_reference(window):
    """The flash-attn backend's window_size (w - 1 keys to the left) is the reference's window:
    decode and paged prefill through the backend's own functions."""
    from types import SimpleNamespace

    from nanovllm.layers.attention import bind_backend
    backend = bind_backend("flash-attn", torch.bfloat16, 128)
    lens = [1, 300, 1000]
    k_cache, v_cache, tables = paged_cache(lens, 8, 128, 256, torch.bfloat16, seed=11)
    layer = SimpleNamespace(k_cache=k_cache, v_cache=v_cache, scale=128 ** -0.5,
                            sliding_window=window, k_scale=1.0, v_scale=1.0)
    q = torch.randn(3, 16, 128, device=DEVICE, dtype=torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = backend.decode(q, layer, SimpleNamespace(context_lens=ctx, block_tables=tables))
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), ctx, tables,
                                     layer.scale, window=window)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    qp = torch.randn(sum(lens), 16, 128, device=DEVICE, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 301, 1301], dtype=torch.int32, device=DEVICE)
    ctxp = SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1000, max_seqlen_k=1000,
                           block_tables=tables)
    out = backend.prefill(qp, None, None, layer, ctxp)
    ref = reference.prefill_attention(qp.double(), None, None, k_cache.double(), v_cache.double(),
                                      cu, cu, 1000, tables, layer.scale, window=window)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                    reason="flash-attn is not installed")
@pytest.mark.parametrize("case", [(16, 8, 128, 256, [1, 300, 1000]), (32, 8, 128, 256, [2048, 17])])
def test_flash_attn_decode_matches_reference(case):
    from flash_attn import flash_attn_with_kvcache
    num_heads, num_kv_heads, head_dim, block_size, lens = case
    k_cache, v_cache, block_tables = paged_cache(lens, num_kv_heads, head_dim, block_size,
                                                 torch.bfloat16, seed=9)
    q = torch.randn(len(lens), num_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), ctx,
                                     block_tables, head_dim ** -0.5)
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx,
                                  block_table=block_tables, softmax_scale=head_dim ** -0.5,
                                  causal=True).squeeze(1)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernels_at_real_shapes(dtype):
    """Qwen3-0.6B's attention shapes: 16 query / 8 KV heads, head_dim 128, page 256."""
    rng = random.Random(0)
    lens = [rng.randint(1, 3000) for _ in range(64)]
    k_cache, v_cache, block_tables = paged_cache(lens, 8, 128, 256, dtype, seed=1)
    q = torch.randn(len(lens), 16, 128, device=DEVICE, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = reference.decode_attention(q.float(), k_cache.float(), v_cache.float(), ctx, block_tables,
                                     128 ** -0.5)
    for splits in (None, 1, 8):
        out = torch.full_like(q, float("nan"))
        triton_attention.decode_attention(q, k_cache, v_cache, ctx, block_tables, 128 ** -0.5,
                                          num_splits=splits, out=out)
        assert rel_err(out, ref.double()) < TOL[dtype]
    seq_lens = [1000, 2048, 1, 513]
    n = sum(seq_lens)
    q = torch.randn(n, 16, 128, device=DEVICE, dtype=dtype)
    k = torch.randn(n, 8, 128, device=DEVICE, dtype=dtype)
    v = torch.randn(n, 8, 128, device=DEVICE, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)
    ref = reference.prefill_attention(q.float(), k.float(), v.float(), k_cache, v_cache, cu, cu,
                                      2048, None, 128 ** -0.5)
    out = triton_attention.prefill_attention(q, k, v, k_cache, v_cache, cu, cu, 2048, None,
                                             128 ** -0.5)
    assert rel_err(out, ref.double()) < TOL[dtype]


# ---- sliding windows and the fp8 cache -----------------------------------------------------------
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int],
                    window: int, scale: float):
    """Float64 attention of queries q [Q, H, D] at positions q_pos over keys k, v [K, KVH, D] at
    positions 0..K-1, key j visible to query i when j <= q_pos[i] and (window == 0 or j >
    q_pos[i] - window)."""
    group = q.size(1) // k.size(1)
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, p in enumerate(q_pos):
        lo = max(0, p - window + 1) if window else 0
        s = torch.einsum("hd,khd->hk", q[i].double(), k[lo:p + 1]) * scale
        out[i] = torch.einsum("hk,khd->hd", s.softmax(-1), v[lo:p + 1])
    return out


def sequence_kv(k_cache, v_cache, block_tables, seq: int, length: int):
    """Sequence ``seq``'s first ``length`` cached K/V, gathered from its blocks (fp8 dequantized at
    scale 1)."""
    block_size = k_cache.size(1)
    pos = torch.arange(length)
    slots = block_tables[seq].cpu()[pos // block_size].long() * block_size + pos % block_size
    return [c.cpu().view(-1, *c.shape[2:])[slots].double() for c in (k_cache, v_cache)]


WINDOWS = [1, 7, 16, 33]


def test_reference_window_matches_naive_attention():
    """The reference's sliding-window masks (decode and a chunked, paged prefill) against explicit
    loops."""
    lens = [40, 9, 70]
    k_cache, v_cache, tables = paged_cache(lens, 2, 32, 16, torch.float64, seed=5)
    q = torch.randn(3, 4, 32, dtype=torch.float64)
    ctx = torch.tensor(lens, dtype=torch.int32)
    for window in WINDOWS:
        out = reference.decode_attention(q, k_cache.cpu(), v_cache.cpu(), ctx, tables.cpu(), 0.2,
                                         window=window)
        for i, n in enumerate(lens):
            k, v = sequence_kv(k_cache, v_cache, tables, i, n)
            torch.testing.assert_close(out[i:i + 1],
                                       naive_attention(q[i:i + 1], k, v, [n - 1], window, 0.2))
        # prefill: the last 30 positions of sequence 2 as one chunk (40 cached before it)
        k, v = sequence_kv(k_cache, v_cache, tables, 2, 70)
        qp = torch.randn(30, 4, 32, dtype=torch.float64)
        cu_q, cu_k = (torch.tensor([0, 30], dtype=torch.int32),
                      torch.tensor([0, 70], dtype=torch.int32))
        out = reference.prefill_attention(qp, k[40:], v[40:], k_cache.cpu(), v_cache.cpu(), cu_q,
                                          cu_k, 30, tables[2:].cpu(), 0.2, window=window)
        torch.testing.assert_close(out, naive_attention(qp, k, v, list(range(40, 70)), window, 0.2))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", [DECODE_CASES[1], DECODE_CASES[4]],
                         ids=lambda c: f"H{c[0]}-KV{c[1]}-S{c[5]}")
def test_decode_attention_sliding_window(case, window):
    num_heads, num_kv_heads, head_dim, block_size, lens, splits = case
    dtype = torch.float32
    k_cache, v_cache, block_tables = paged_cache(lens, num_kv_heads, head_dim, block_size, dtype,
                                                 seed=window)
    q = torch.randn(len(lens), num_heads, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), ctx,
                                     block_tables, 0.1, window=window)
    for s in (1, splits):
        out = torch.full_like(q, float("nan"))
        triton_attention.decode_attention(q, k_cache, v_cache, ctx, block_tables, 0.1,
                                          window=window, num_splits=s, out=out)
        assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("window", [5, 16, 40])
@pytest.mark.parametrize("case", [PREFILL_CASES[0], PREFILL_CASES[2], PREFILL_CASES[4]],
                         ids=lambda c: f"H{c[0]}-KV{c[1]}-{c[4]}")
def test_prefill_attention_sliding_window(case, window):
    """Windows shorter and longer than the 64-row tiles: rows whose window starts past a key tile
    see none of it (no NaN), cached prefixes and chunks across the window's edge."""
    num_heads, num_kv_heads, head_dim, block_size, seqs = case
    q, k, v, k_cache, v_cache, cu_q, cu_k, max_q, tables = prefill_inputs(case, torch.float32,
                                                                          seed=window)
    ref = reference.prefill_attention(q.double(), k.double(), v.double(), k_cache.double(),
                                      v_cache.double(), cu_q, cu_k, max_q, tables, 0.1,
                                      window=window)
    out = torch.full_like(q, float("nan"))
    triton_attention.prefill_attention(q, k, v, k_cache, v_cache, cu_q, cu_k, max_q, tables, 0.1,
                                       window=window,
                                       config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4,
                                                   num_stages=1), out=out)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype,shift", [(torch.float16, -20.0), (torch.float32, -100.0)],
                         ids=["fp16", "fp32"])
def test_prefill_window_scores_far_below_zero(dtype, shift):
    """Rows of a query tile meet key tiles wholly before their window: their running max must stay
    -inf there, or scores far below zero underflow once a visible key comes (zeros in fp16, errors
    in fp32)."""
    n, d, window = 48, 32, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, 1, d, generator=g)
    q = q / q.norm(dim=-1, keepdim=True)
    k = q.roll(1, 0) * 0.1
    q[..., 0], k[..., 0] = 1.0, shift   # every score about `shift`
    v = torch.randn(n, 1, d, generator=g)
    q, k, v = (x.to(dtype).to(DEVICE) for x in (q, k, v))
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    ref = reference.prefill_attention(q.double(), k.double(), v.double(), None, None, cu, cu, n,
                                      None, 1.0, window=window)
    out = triton_attention.prefill_attention(q, k, v, k, v, cu, cu, n, None, 1.0, window=window,
                                             config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4,
                                                         num_stages=1))
    # fp32: scores near -100 carry ~100 * 2^-24 of rounding each, and the GPU's exp2 is approximate
    # (1.07e-5 on an H200); a running max left at 0 instead gives 2^-144-sized, subnormal
    # probabilities, errors of 1e-2 and more
    assert rel_err(out, ref) < (1e-4 if dtype == torch.float32 else TOL[dtype])


def fp8_close(got: torch.Tensor, want: torch.Tensor):
    """Two fp8 tensors equal to within one e4m3 rounding step (3 mantissa bits; 2^-9 below the
    normals)."""
    got, want = got.float(), want.float()
    assert ((got - want).abs() <= want.abs() / 8 + 2 ** -9).all()


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("scales", [(1.0, 1.0), (2.5, 0.25)], ids=["scale1", "scaled"])
def test_store_kvcache_fp8(scales):
    """The Triton store writes the reference's bytes: x / scale rounded to e4m3, saturated at
    +-448."""
    k_scale, v_scale = scales
    for dtype in DTYPES:
        n, kvh, d = 7, 2, 64
        k = (torch.randn(n, kvh, d) * 40).to(dtype)
        # saturation at +-448 (not NaN)
        k[0, 0, :4] = torch.tensor([1e4, -1e4, 449.0 * k_scale, 0.0])
        v = (torch.randn(n, kvh, d) * 3).to(dtype)
        slots = torch.tensor([3, -1, 0, 15, 8, -1, 9], dtype=torch.int32)
        ref_k, ref_v = torch.zeros(4, 4, kvh, d, dtype=FP8), torch.zeros(4, 4, kvh, d, dtype=FP8)
        reference.store_kvcache(k, v, ref_k, ref_v, slots, k_scale, v_scale)
        k_cache, v_cache = (torch.zeros(4, 4, kvh, d, dtype=FP8, device=DEVICE),
                            torch.zeros_like(ref_v, device=DEVICE))
        triton_attention.store_kvcache(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache,
                                       slots.to(DEVICE), k_scale, v_scale)
        assert torch.equal(k_cache.cpu().view(torch.uint8), ref_k.view(torch.uint8))
        assert torch.equal(v_cache.cpu().view(torch.uint8), ref_v.view(torch.uint8))
        flat = ref_k.view(16, kvh, d).float()
        assert flat[3, 0, :3].tolist() == [448.0, -448.0, 448.0]
        torch.testing.assert_close(flat[0] * k_scale, k[2].float(), rtol=1 / 8,
                                   atol=2 ** -9 * k_scale)


def test_store_kvcache_fp8_rounds_as_torch():
    """Every e4m3 value, every midpoint between neighbours (ties to even) and just off each
    midpoint, stored by the Triton kernel: the bytes of torch's float32 -> e4m3 conversion
    (saturated at +-448)."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mid, mid.nextafter(grid[1:]), mid.nextafter(grid[:-1]),
                   torch.tensor([500.0, -1e6])])
    x = torch.cat([x, torch.zeros(-len(x) % 16)]).view(-1, 1, 16)
    k_cache = torch.zeros(len(x), 1, 1, 16, dtype=FP8, device=DEVICE)
    slots = torch.arange(len(x), dtype=torch.int32, device=DEVICE)
    triton_attention.store_kvcache(x.to(DEVICE), x.to(DEVICE), k_cache, torch.zeros_like(k_cache),
                                   slots)
    want = x.clamp(-448, 448).to(FP8)
    assert torch.equal(k_cache.cpu().view(torch.uint8).flatten(), want.view(torch.uint8).flatten())


def fp8_cache(lens, num_kv_heads, head_dim, block_size, seed):
    k_cache, v_cache, tables = paged_cache(lens, num_kv_heads, head_dim, block_size, torch.float32,
                                           seed)
    return (k_cache * 30).to(FP8), (v_cache * 0.1).to(FP8), tables


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE_CASES[:3],
                         ids=lambda c: f"H{c[0]}-KV{c[1]}-D{c[2]}-S{c[5]}")
def test_decode_attention_fp8(case, dtype):
    """Triton reads the fp8 cache as the reference does: each value times its scale (the reference
    in float64)."""
    num_heads, num_kv_heads, head_dim, block_size, lens, splits = case
    k_cache, v_cache, block_tables = fp8_cache(lens, num_kv_heads, head_dim, block_size,
                                               seed=len(lens))
    q = torch.randn(len(lens), num_heads, head_dim, device=DEVICE).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = reference.decode_attention(q.double(), k_cache, v_cache, ctx, block_tables, 0.05, 0.5,
                                     4.0)
    out = torch.full_like(q, float("nan"))
    triton_attention.decode_attention(q, k_cache, v_cache, ctx, block_tables, 0.05, 0.5, 4.0,
                                      num_splits=splits, out=out)
    assert rel_err(out, ref) < TOL[dtype]
    # the scales matter: at 1.0 the result differs (so neither kernel ignores them)
    assert rel_err(reference.decode_attention(q.double(), k_cache, v_cache, ctx, block_tables,
                                              0.05), ref) > 0.1


def prefill_inputs(case, dtype, seed: int, fp8_scales: tuple[float, float] | None = None):
    """PREFILL_CASES' inputs: the new tokens' q, k, v, stored into a paged cache (fp8 at the scales
    when given) when any sequence has a cached part, which then comes from the same cache."""
    num_heads, num_kv_heads, head_dim, block_size, seqs = case
    paged = any(cached for cached, _ in seqs)
    lens_k = [c + n for c, n in seqs]
    k_cache, v_cache, block_tables = (fp8_cache if fp8_scales
                                      else functools.partial(paged_cache, dtype=dtype))(
        lens_k, num_kv_heads, head_dim, block_size, seed=seed)
    num_new = sum(n for _, n in seqs)
    q = torch.randn(num_new, num_heads, head_dim, device=DEVICE).to(dtype)
    k = (torch.randn(num_new, num_kv_heads, head_dim, device=DEVICE) * 3).to(dtype)
    v = torch.randn(num_new, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    cu_q = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))],
                        dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(lens_k[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    if paged:
        slots = [block_tables[i, p // block_size].item() * block_size + p % block_size
                 for i, (c, n) in enumerate(seqs) for p in range(c, c + n)]
        reference.store_kvcache(k, v, k_cache, v_cache,
                                torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                                *(fp8_scales or (1.0, 1.0)))
    return (q, k, v, k_cache, v_cache, cu_q.to(DEVICE), cu_k.to(DEVICE), max(n for _, n in seqs),
            block_tables if paged else None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES[2:],
                         ids=lambda c: f"H{c[0]}-KV{c[1]}-D{c[2]}-{c[4]}")
def test_prefill_attention_fp8(case, dtype):
    """Paged prefill (cached prefix and chunks) over an fp8 cache, new tokens stored at scales 2 and
    0.5."""
    q, k, v, k_cache, v_cache, cu_q, cu_k, max_q, tables = prefill_inputs(case, dtype, seed=1,
                                                                          fp8_scales=(2.0, 0.5))
    ref = reference.prefill_attention(q.double(), k.double(), v.double(), k_cache, v_cache, cu_q,
                                      cu_k, max_q, tables, 0.1, 2.0, 0.5)
    out = torch.full_like(q, float("nan"))
    triton_attention.prefill_attention(q, k, v, k_cache, v_cache, cu_q, cu_k, max_q, tables, 0.1,
                                       2.0, 0.5, out=out)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.gpu
def test_fp8_kernels_at_real_shapes():
    """Qwen3-0.6B's attention over an fp8 cache at page 256, compiled (the interpreter rounds e4m3
    its own way): the store's bytes equal torch's conversion; decode (split and not) and paged
    prefill match the reference reading the same cache, with scales and with a window."""
    rng = random.Random(2)
    lens = [rng.randint(1, 3000) for _ in range(64)]
    k_cache, v_cache, tables = fp8_cache(lens, 8, 128, 256, seed=2)
    q = torch.randn(len(lens), 16, 128, device=DEVICE, dtype=torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for window in (0, 1000):
        ref = reference.decode_attention(q.float(), k_cache, v_cache, ctx, tables, 0.05, 0.5, 4.0,
                                         window)
        for splits in (None, 1, 8):
            out = triton_attention.decode_attention(q, k_cache, v_cache, ctx, tables, 0.05, 0.5,
                                                    4.0, window, num_splits=splits)
            assert rel_err(out, ref.double()) < TOL[torch.bfloat16]
    x = torch.randn(4096, 8, 128, device=DEVICE, dtype=torch.bfloat16) * 100
    kc, vc = (torch.zeros(16, 256, 8, 128, dtype=FP8, device=DEVICE) for _ in range(2))
    slots = torch.randperm(4096, device=DEVICE).int()
    triton_attention.store_kvcache(x, x, kc, vc, slots, 2.0, 0.5)
    flat = kc.view(-1, 8, 128)[slots.long()]
    assert torch.equal(flat.view(torch.uint8),
                       (x.float() / 2.0).clamp(-448, 448).to(FP8).view(torch.uint8))
    case = (16, 8, 128, 256, [(1000, 300), (0, 700), (2048, 1)])
    q, k, v, k_cache, v_cache, cu_q, cu_k, max_q, tables = prefill_inputs(
        case, torch.bfloat16, seed=3, fp8_scales=(2.0, 0.5))
    for window in (0, 512):
        ref = reference.prefill_attention(q.float(), k.float(), v.float(), k_cache, v_cache, cu_q,
                                          cu_k, max_q, tables, 0.05, 2.0, 0.5, window)
        out = triton_attention.prefill_attention(q, k, v, k_cache, v_cache, cu_q, cu_k, max_q,
                                                 tables, 0.05, 2.0, 0.5, window)
        assert rel_err(out, ref.double()) < TOL[torch.bfloat16]


def test_qk_norm_rope_store_fp8():
    """The fused prologue writes the fp8 cache as the reference store does with the same scales."""
    num_heads, num_kv_heads, d, n = 4, 2, 64, 6
    g = torch.Generator().manual_seed(4)
    qkv = (torch.randn(n, (num_heads + 2 * num_kv_heads) * d, generator=g) * 20).to(DEVICE)
    positions = torch.tensor([0, 5, 17, 3, 99, 1], device=DEVICE)
    slots = torch.tensor([3, -1, 0, 31, 8, 9], dtype=torch.int32, device=DEVICE)
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    rope = RotaryEmbedding(d, 128, 10000.0).to(DEVICE)
    k_cache, v_cache = (torch.zeros(8, 4, num_kv_heads, d, dtype=FP8, device=DEVICE)
                        for _ in range(2))
    _, out_k, out_v = triton_attention.qk_norm_rope_store(qkv, positions, rope.cos_sin_cache, None,
                                                          None, 0.0, k_cache, v_cache, slots,
                                                          num_heads, num_kv_heads, d, 3.0, 0.5)
    ref_k, ref_v = (torch.zeros(8, 4, num_kv_heads, d, dtype=FP8) for _ in range(2))
    reference.store_kvcache(out_k.cpu(), out_v.cpu(), ref_k, ref_v, slots.cpu(), 3.0, 0.5)
    fp8_close(k_cache.cpu(), ref_k)
    fp8_close(v_cache.cpu(), ref_v)
    assert k_cache.float().abs().max() > 0


# ---- the dense layers: RMSNorm, SiLU-and-mul, the skinny linear ----------------------------------
triton_linear = pytest.importorskip("nanovllm.kernels.triton_linear")


def check_linear(m: int, k: int, n: int, dtype, fusion: str, bias: bool, seed: int = 0):
    """triton_linear.linear against float64 separate ops, within the dtype's tolerance. ``fusion``:
    "" (plain), "silu" (the weight is [gate; up], 2n rows) or "residual" (the add after the
    projection, in place)."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if fusion == "silu" else n
    x, residual = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
    weight, b = torch.randn(rows, k, generator=g) / k ** 0.5, torch.randn(rows, generator=g)
    x, residual, weight, b = (t.to(DEVICE, dtype) for t in (x, residual, weight, b))
    into = residual.clone() if fusion == "residual" else None
    out = triton_linear.linear(x, weight, b if bias else None, silu_mul=fusion == "silu",
                               residual=into)
    assert into is None or out is into, "the residual is updated in place"
    ref = torch.nn.functional.linear(x.double(), weight.double(), b.double() if bias else None)
    ref = (reference.silu_and_mul(ref) if fusion == "silu"
           else ref + residual.double() if fusion else ref)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype], (m, k, n, fusion, bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fusion", ["", "silu", "residual"], ids=["plain", "silu", "residual"])
def test_skinny_linear_matches_separate_ops(fusion, dtype):
    """Row counts up to the skinny limit and past it (cuBLAS, the activation kernel, the residual in
    cuBLAS's epilogue), K and N not multiples of the tiles, with and without bias."""
    for m in (1, 5, triton_linear.SKINNY_MAX_M, triton_linear.SKINNY_MAX_M + 1, 40):
        check_linear(m, 200, 72, dtype, fusion, bias=m % 2 == 1, seed=m)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_and_silu_and_mul_kernels(dtype):
    """The norm kernel (many rows: prefill) and SiLU-and-mul against the reference, which rounds the
    same way."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 300, generator=g).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(300, generator=g)).to(DEVICE, dtype)
    assert rel_err(triton_linear.rms_norm(x, weight, 1e-6),
                   reference.rms_norm(x, weight, 1e-6).double()) < TOL[dtype] / 4
    gate_up = torch.randn(37, 2 * 1100, generator=g).to(DEVICE, dtype)
    assert rel_err(triton_linear.silu_and_mul(gate_up),
                   reference.silu_and_mul(gate_up.double())) < TOL[dtype] / 4


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 64])
def test_skinny_linear_at_real_shapes(m):
    """The decode projections of Qwen3-0.6B and -8B (K, N) with their fusions, in bf16; the LM head
    of 0.6B."""
    shapes = [(1024, 4096, ""), (2048, 1024, "residual"), (1024, 3072, "silu"),
              (3072, 1024, "residual"), (4096, 6144, ""), (4096, 4096, "residual"),
              (4096, 12288, "silu"), (12288, 4096, "residual"), (1024, 151936, "")]
    for k, n, fusion in shapes:
        check_linear(m, k, n, torch.bfloat16, fusion, bias=False, seed=k + n)


# ---- the one-pass sampler of plain batches ------------------------------------------------------
def test_triton_sampler_greedy_is_argmax():
    """Temperature 0 rows are exactly argmax, ties to the lowest id, across chunks and a ragged
    end."""
    from nanovllm.kernels import triton_sampler
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 1000, generator=g).to(torch.bfloat16)
    logits[1, 700] = logits[1, 33] = 9.0          # a tie across chunks: 33 wins
    logits[2, 64:70] = 9.0                        # a tie inside a chunk
    logits[3, 999] = 9.0                          # the last id, in the ragged last chunk
    logits[4] = float("-inf")
    logits[4, 517] = 0.0
    logits = logits.to(DEVICE)
    t = torch.zeros(6, device=DEVICE)
    for quarter in (16, 64, 1024):               # many chunks, some, one
        got = triton_sampler.sample(logits, t, seed=5, quarter=quarter)
        assert got.tolist() == logits.float().argmax(-1).tolist()
        assert got[1] == 33 and got[2] == 64 and got[3] == 999 and got[4] == 517
    if CUDA:  # bench.py's shape: 256 rows of Qwen3's vocabulary
        logits = torch.randn(256, 151936, device=DEVICE).to(torch.bfloat16)
        got = triton_sampler.sample(logits, torch.zeros(256, device=DEVICE), seed=5)
        assert torch.equal(got, logits.float().argmax(-1))



@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_triton_sampler_marks_rows_with_a_nan_or_inf_logit(temperature):
    """A row with a NaN or +inf logit anywhere (a chunk other than the winner's too) samples -1,
    which the engine ends with an error; -inf (a mask) is a plain logit; other rows as before."""
    from nanovllm.kernels import triton_sampler
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(2))
    logits[0, 17] = float("nan")
    logits[1, 990] = float("inf")
    logits[2] = float("nan")
    logits[3, :500] = float("-inf")
    logits = logits.to(DEVICE)
    t = torch.full((5,), temperature, device=DEVICE)
    for quarter in (16, 1024):
        got = triton_sampler.sample(logits, t, seed=9, quarter=quarter).tolist()
        assert got[:3] == [-1, -1, -1] and got[3] >= 500 and got[4] >= 0
        if temperature == 0:
            assert got[3:] == logits[3:].argmax(-1).tolist()
    from nanovllm.layers.sampler import Sampler, SamplingBatch  # the torch path marks them too
    got = Sampler()(logits.cpu(), SamplingBatch(temperatures=t.cpu(), top_k=torch.full((5,), 1000)))
    assert got[0][:3].tolist() == [-1, -1, -1] and got[0][3] >= 500

def test_triton_sampler_distribution_and_seeds():
    """Sampled rows follow softmax(logits / T) (within 4.5 sigma over 495 draws), greedy
    rows in the same batch stay argmax, and the seed alone decides the draw."""
    from nanovllm.kernels import triton_sampler
    vocab = 10
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0, -8.0, 0.2])
    rows = 500
    logits = base.repeat(rows, 1).to(DEVICE)
    t = torch.full((rows,), 0.7, device=DEVICE)
    t[::100] = 0.0
    got = triton_sampler.sample(logits, t, seed=123, quarter=16)
    assert (got[::100] == 7).all()
    sampled = got[t > 0].cpu()
    p = torch.softmax(base / 0.7, -1)
    freq = torch.bincount(sampled, minlength=vocab).double() / sampled.numel()
    sigma = (p * (1 - p) / sampled.numel()).sqrt()
    assert ((freq - p).abs() <= 4.5 * sigma + 1e-9).all(), (freq, p)
    # (on 40 rows: the interpreter runs a program in ~30 ms)
    assert torch.equal(got[:40], triton_sampler.sample(logits[:40], t[:40], seed=123, quarter=16))
    other = triton_sampler.sample(logits[:40], t[:40], seed=124, quarter=16)
    assert (other != got[:40]).float().mean() > 0.3
    # the row and the chunk are part of the counter: rows with the same logits draw differently
    assert len(set(sampled[:50].tolist())) > 2


@functools.cache
def _kernel_asm() -> dict:
    """tools/kernel_asm.py's counts for the sm_90 builds of the kernels (compiled here, no GPU
    needed)."""
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "kernel_asm.py"), "--json"],
                         env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_fp8_tiles_never_cross_shared_memory_a_byte_at_a_time():
    """Compiled for sm_90 here (no GPU needed; tools/kernel_asm.py): over an fp8 cache the decode
    and paged prefill kernels shuffle V as fp16 (ldmatrix), not as bytes. When Triton was left to
    place V's conversion it moved it after the shuffle: 128 ld.shared.b8 and st.shared.b8 a tile,
    byte-wise traffic that slows fp8 decode."""
    rows = _kernel_asm()
    for name in ("decode fp8", "decode fp8, 64-key tiles", "prefill paged fp8"):
        row = rows[name]
        assert row["ld.shared.b8"] == row["st.shared.b8"] == 0 and row["ldmatrix"] > 0, (name, row)
        # the tiles are converted by the hardware's instruction
        assert row["cvt.e4m3x2"] > 0, (name, row)
    assert rows["decode bf16"]["mma.sync"] > 0 and rows["prefill paged bf16"]["wgmma"] > 0
    # compiled as launched: aligned, pipelined loads
    assert all(row["cp.async"] > 0 for row in rows.values())
