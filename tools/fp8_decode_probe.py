"""Where an fp8 KV cache's decode time goes: the decode loop of nanovllm/kernels/triton_attention.py
rewritten with one stage changed at a time, timed against the engine's kernel on the same cache
(CUDA Graph replays).

Modes of the probe kernel (one program per sequence and KV head, no splits: batch >= 64):
  full      as the engine's kernel was until its V fix: K, V tiles converted to fp16 (the conversion
            of V left where Triton moves it: after V's 8-bit shuffle into the product's operand
            layout, through shared memory a byte at a time), both products on the tensor cores; the
            "engine" column is the kernel now
  no_pv     the same without the P @ V product (what the second product and V's conversion cost)
  no_qk     the same without the Q @ K^T product (scores all 0: what the first product and K's
            conversion cost)
  fp8_qk    the queries quantized to e4m3 (one scale a row) and Q @ K^T in fp8: no conversion of K
  k_as_a    Q @ K^T computed as K @ Q^T (K the product's first operand, which may stay in registers)
  load      the tiles loaded and summed as bytes: the access pattern's bandwidth, no arithmetic to
            speak of

    python tools/fp8_decode_probe.py [--out DIR]
    (CUDA; TRITON_INTERPRET=1 checks the modes on CPU)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanovllm.kernels import triton_attention as ta  # noqa: E402

MODES = {"full": 0, "no_pv": 1, "fp8_qk": 2, "k_as_a": 3, "load": 4, "no_qk": 5}
H, KVH, D = 16, 8, 128
LOG2E = 1.4426950408889634


@triton.jit
def _probe_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, o_ptr, qk_scale, stride_bt,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  MODE: tl.constexpr):
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    rows = (seq * (NUM_KV_HEADS * GROUP) + heads)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptr + rows, mask=(offs_g < GROUP)[:, None], other=0.0).to(tl.float32)
    q_scale = tl.full([BLOCK_G], 1.0, tl.float32)
    if MODE == 2:
        amax = tl.max(tl.abs(q), 1)
        q_scale = tl.where(amax > 0, amax / 448.0, 1.0)
        q8 = (q / q_scale[:, None]).to(tl.float8e4nv)
    q16 = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    total = tl.zeros([HEAD_DIM], tl.int32)
    for start in range(0, ctx, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < ctx
        page = tl.load(bt_ptr + seq * stride_bt + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
        kv_off = ((page * PAGE + offs_n % PAGE)[:, None] * (NUM_KV_HEADS * HEAD_DIM)
                  + kv_head * HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_off + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off + offs_d[None, :], mask=valid[:, None], other=0.0)
        if MODE == 4:
            both = (k.to(tl.uint8, bitcast=True).to(tl.int32)
                    + v.to(tl.uint8, bitcast=True).to(tl.int32))
            total += tl.sum(both, 0)
        else:
            if MODE == 2:
                s = tl.dot(q8, tl.trans(k)) * (q_scale[:, None] * qk_scale)
            elif MODE == 3:
                s = tl.trans(tl.dot(k.to(tl.float16), tl.trans(q16))) * qk_scale
            elif MODE == 5:
                s = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
            else:
                s = tl.dot(q16, tl.trans(k.to(tl.float16))) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if MODE != 1:
                acc += tl.dot(p.to(tl.float16), v.to(tl.float16))
            m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if MODE == 4:
        out += total[None, :].to(tl.float32)
    tl.store(o_ptr + rows, out.to(o_ptr.dtype.element_ty), mask=(offs_g < GROUP)[:, None])


def probe(mode: str, q, k_cache, v_cache, context_lens, tables, scale, block_n: int,
          num_warps: int, out):
    group = H // KVH
    _probe_kernel[(q.size(0), KVH)](
        q, k_cache, v_cache, tables, context_lens, out, scale * LOG2E, tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), NUM_KV_HEADS=KVH, HEAD_DIM=D,
        PAGE=k_cache.size(1), BLOCK_N=block_n, MODE=MODES[mode], num_warps=num_warps, num_stages=2)
    return out


def caches(batch: int, ctx: int, page: int, device: str):
    pages = triton.cdiv(ctx, page)
    k_cache = torch.randn(batch * pages, page, KVH, D, device=device).to(torch.float8_e4m3fn)
    v_cache = torch.randn(batch * pages, page, KVH, D, device=device).to(torch.float8_e4m3fn)
    tables = torch.randperm(batch * pages, device=device, dtype=torch.int32).view(batch, pages)
    return k_cache, v_cache, tables


def check(device: str) -> list[dict]:
    """Each arithmetic mode against the engine's kernel on a small cache (fp8_qk also quantizes the
    queries)."""
    rows = []
    batch, ctx, page = 3, 100, 16
    k_cache, v_cache, tables = caches(batch, ctx, page, device)
    q = torch.randn(batch, H, D, device=device, dtype=torch.bfloat16)
    lens = torch.tensor([ctx, ctx - 37, 1], dtype=torch.int32, device=device)
    ref = ta.decode_attention(q, k_cache, v_cache, lens, tables, D ** -0.5, num_splits=1).float()
    for mode in ("full", "no_pv", "fp8_qk", "k_as_a", "no_qk"):
        out = torch.full_like(q, float("nan"))
        try:
            probe(mode, q, k_cache, v_cache, lens, tables, D ** -0.5, 16, 4, out)
        except Exception as e:  # a mode this Triton cannot compile is reported, not fatal
            rows.append(dict(kind="check", mode=mode, error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        err = float((out.float() - ref).norm() / ref.norm())
        rows.append(dict(kind="check", mode=mode, rel_err_vs_engine=err,
                         finite=bool(out.isfinite().all())))
    return rows


def timings() -> list[dict]:
    from bench_kernels import bench_graph
    rows = []
    for batch, ctx, page in ((256, 2048, 256), (256, 8192, 256), (512, 8192, 256), (256, 8192, 64)):
        k_cache, v_cache, tables = caches(batch, ctx, page, "cuda")
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        nbytes = 2 * batch * ctx * KVH * D
        out = torch.empty_like(q)
        engine = bench_graph(partial(ta.decode_attention, q, k_cache, v_cache, lens, tables,
                                     D ** -0.5, num_splits=1, out=out))
        k16, v16 = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
        engine_bf16 = bench_graph(partial(ta.decode_attention, q, k16, v16, lens, tables, D ** -0.5,
                                          num_splits=1, out=out))
        del k16, v16
        row = dict(kind="time", batch=batch, ctx=ctx, page=page, gbytes=nbytes / 1e9,
                   engine_us=engine * 1e6, engine_tbs=nbytes / engine / 1e12,
                   engine_bf16_us=engine_bf16 * 1e6)
        for mode in MODES:
            for block_n, warps in ((64, 4), (128, 4), (128, 8)):
                try:
                    t = bench_graph(partial(probe, mode, q, k_cache, v_cache, lens, tables,
                                            D ** -0.5, block_n, warps, out))
                except Exception as e:
                    row[f"{mode}_{block_n}_{warps}"] = f"{type(e).__name__}"
                    continue
                row[f"{mode}_{block_n}_{warps}_tbs"] = round(nbytes / t / 1e12, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    rows = check("cuda" if cuda else "cpu")
    for row in rows:
        print(json.dumps(row), flush=True)
    if cuda:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        rows += timings()
        meta = dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__,
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_decode_probe.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(json.dumps(meta))


if __name__ == "__main__":
    main()
