"""Kernel microbenchmarks on one GPU: our Triton attention beside flash-attn's, and our
decode-shaped linear layers beside cuBLAS, same shapes, same run.

Decode: KV bytes read per second (every cached K and V of every sequence read once) at batch
1/16/64/256/512 x context 512/2048/8192. Prefill: TFLOP/s (4 * heads * head_dim per visible
query-key pair) at 1-16 sequences x 512-8192 tokens, with and without a cached prefix. Also
the device copy bandwidth (bytes read + written). Linear (``--only linear`` for these alone): the
decode projections of Qwen3-0.6B and -8B and 0.6B's LM head at 1-256 rows, weight bytes read per
second by cuBLAS alone, by the unfused chain (norm kernel, cuBLAS, SiLU-and-mul kernel) and by the
fused skinny kernel (M <= 16), with ``--sweep`` over its tile sizes. MoE (``--only moe``):
Qwen3-30B-A3B's experts (128 of 2048 x 768, top-8; one layer) at 1-4096 tokens, the fused kernel
against a loop over the experts the batch touches of cuBLAS GEMMs (gather, gate/up, SiLU-and-mul,
down, weighted index_add; the routing found beforehand, so the loop has no host sync), both replayed
from CUDA Graphs over 8 routings, in expert weight bytes read per second (each touched expert once;
``layer_us`` adds the top-k), ``--sweep`` over its tiles; beside it the same experts in block-wise
fp8 (Qwen3-30B-A3B-FP8's 128x128 blocks, x in bf16) through the fp8 kernel, in their e4m3 and scale
bytes read per second (``fp8_*``; ``fp8_speedup``: the bf16 kernel's time over the fp8 one's).
Shapes: Qwen3-0.6B's attention (16 query / 8 KV heads, head_dim 128), bf16, page 256. Timings are
medians of triton.testing.do_bench; decode calls are captured in a CUDA Graph and replayed, as the
engine runs them. ``--kv-cache-dtype fp8``: the decode rows alone over an fp8 (e4m3) cache, its
bytes counted at one a value (kernels_fp8.json). ``--page``: the decode rows' page size;
``--only decode``: those rows alone.

    python tools/bench_kernels.py [--out DIR] [--no-flash] [--sweep]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanovllm.kernels import triton_attention as ta  # noqa: E402
from nanovllm.kernels import triton_linear as tlin  # noqa: E402
from nanovllm.kernels import triton_moe as tmoe  # noqa: E402

H, KVH, D, PAGE, DTYPE = 16, 8, 128, 256, torch.bfloat16
SCALE = D ** -0.5


def bench(fn, rep: int = 100) -> float:
    """Median seconds of one call (rep: milliseconds of repetitions)."""
    return triton.testing.do_bench(fn, warmup=min(25, rep), rep=rep, return_mode="median") / 1e3


def bench_graph(fn, rep: int = 100) -> float:
    """Median seconds of one call replayed from a CUDA Graph, as the engine's decode runs: no host
    launch overhead in the number."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, rep)


def fastest(default_seconds: float, candidates) -> tuple[float, object]:
    """(seconds, config) of the fastest of the default (config "default") and ``candidates``, pairs
    of a config and a function timing it; a config that does not compile (too much shared memory) is
    skipped and named."""
    best = (default_seconds, "default")
    for cfg, time_it in candidates:
        try:
            seconds = time_it()
        except Exception as e:
            print("skip", cfg, repr(e)[:80], file=sys.stderr)
            continue
        if seconds < best[0]:
            best = (seconds, cfg)
    return best


def copy_bandwidth() -> float:
    x = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / bench(lambda: y.copy_(x))


def paged_kv(lens: list[int], page: int = PAGE, kv_dtype: torch.dtype = DTYPE):
    """Caches holding every sequence's context in shuffled pages, and its block tables."""
    pages = [triton.cdiv(n, page) for n in lens]
    total = sum(pages)
    k_cache = torch.randn(total, page, KVH, D, device="cuda", dtype=DTYPE).to(kv_dtype)
    v_cache = torch.randn(total, page, KVH, D, device="cuda", dtype=DTYPE).to(kv_dtype)
    order = torch.randperm(total, device="cuda", dtype=torch.int32)
    width = max(pages)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(pages):
        tables[i, :n] = order[start:start + n]
        start += n
    return k_cache, v_cache, tables


def decode_configs(kv_dtype: torch.dtype) -> list[dict]:
    """The decode tiles swept; an fp8 cache's tiles are half the bytes, so 256 keys a tile are tried
    too."""
    tiles = (64, 128, 256) if kv_dtype.itemsize == 1 else (64, 128)
    return [dict(BLOCK_N=bn, num_warps=w, num_stages=s)
            for bn in tiles for w in (4, 8) for s in (2, 3)]


def decode_rows(flash, sweep: bool, kv_dtype: torch.dtype = DTYPE, page: int = PAGE):
    rows = []
    for batch in (1, 16, 64, 256, 512):
        for ctx in (512, 2048, 8192):
            lens = [ctx] * batch
            k_cache, v_cache, tables = paged_kv(lens, page, kv_dtype)
            q = torch.randn(batch, H, D, device="cuda", dtype=DTYPE)
            cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
            nbytes = 2 * batch * ctx * KVH * D * kv_dtype.itemsize
            row = dict(kind="decode", batch=batch, ctx=ctx, gbytes=nbytes / 1e9,
                       kv_cache_dtype=str(kv_dtype), page=page)
            args = (q, k_cache, v_cache, cl, tables, SCALE)
            t = bench_graph(partial(ta.decode_attention, *args))
            row.update(triton_us=t * 1e6, triton_tbs=nbytes / t / 1e12,
                       splits=ta.num_decode_splits(batch, KVH, q.device))
            if sweep:
                best = fastest(t, ((dict(cfg, splits=splits),
                                    partial(bench_graph, partial(ta.decode_attention, *args,
                                                                 num_splits=splits, config=cfg),
                                            rep=30))
                                   for cfg in decode_configs(kv_dtype)
                                   for splits in sorted({row["splits"],
                                                         min(32, 2 * row["splits"])})))
                row.update(best_tbs=nbytes / best[0] / 1e12, best_config=best[1])
            if flash is not None:
                tf = bench_graph(partial(flash.flash_attn_with_kvcache, q.unsqueeze(1), k_cache,
                                         v_cache, cache_seqlens=cl, block_table=tables,
                                         softmax_scale=SCALE, causal=True))
                row.update(flash_us=tf * 1e6, flash_tbs=nbytes / tf / 1e12)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# (model, layer, K, N, fusion): "silu" is SiLU-and-mul after the projection (N is then the output
# width: the weight has 2N rows), "residual" the residual add after it
LINEAR_SHAPES = [("0.6b", "qkv_proj", 1024, 4096, ""), ("0.6b", "o_proj", 2048, 1024, "residual"),
                 ("0.6b", "gate_up_proj", 1024, 3072, "silu"),
                 ("0.6b", "down_proj", 3072, 1024, "residual"),
                 ("0.6b", "lm_head", 1024, 151936, ""),
                 ("8b", "qkv_proj", 4096, 6144, ""), ("8b", "o_proj", 4096, 4096, "residual"),
                 ("8b", "gate_up_proj", 4096, 12288, "silu"),
                 ("8b", "down_proj", 12288, 4096, "residual")]
SKINNY_CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
                  for bn, bk, w, st in [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3),
                                        (64, 128, 4, 3), (32, 512, 8, 2), (64, 256, 8, 2)]]
# the sweep's shapes (compiles are slow)
SWEPT = {("0.6b", "o_proj"), ("8b", "gate_up_proj"), ("8b", "down_proj")}


def bench_graph_each(fns: list, rep: int = 100) -> float:
    """Median seconds per call of ``fns`` captured back to back in one CUDA Graph: what one kernel
    costs inside the engine's decode graph (the graph's own launch spread over the calls)."""
    return bench_graph(lambda: [fn() for fn in fns], rep) / len(fns)


def linear_rows(sweep: bool, bw: float):
    """The skinny kernel against cuBLAS with the same fusion done the unfused way (cuBLAS, then the
    activation kernel; the residual in cuBLAS's epilogue), per decode shape and row count."""
    rows = []
    for model, layer, k, n, fusion in LINEAR_SHAPES:
        silu = fusion == "silu"
        nbytes = (2 if silu else 1) * n * k * DTYPE.itemsize
        # enough copies of the weight that the L2 cache (50 MB) holds none of them
        # when it comes round again
        weights = [torch.randn((2 if silu else 1) * n, k, device="cuda", dtype=DTYPE) / k ** 0.5
                   for _ in range(max(4, triton.cdiv(200 * 2 ** 20, nbytes)))]
        for m in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            x, residual = (torch.randn(m, k, device="cuda", dtype=DTYPE),
                           torch.randn(m, n, device="cuda", dtype=DTYPE))
            kwargs = dict(silu_mul=silu, residual=residual if fusion == "residual" else None)
            row = dict(kind="linear", model=model, layer=layer, k=k, n=n, fusion=fusion, m=m,
                       weight_mb=nbytes / 1e6)
            t_cublas = bench_graph_each([partial(torch.nn.functional.linear, x, w)
                                         for w in weights])
            t_chain = bench_graph_each([partial(_unfused, x, w, silu, kwargs["residual"])
                                        for w in weights])
            row.update(cublas_us=t_cublas * 1e6, cublas_of_copy=nbytes / t_cublas / bw,
                       unfused_us=t_chain * 1e6)
            if m <= tlin.SKINNY_MAX_M:
                t = bench_graph_each([partial(tlin.linear, x, w, **kwargs) for w in weights])
                row.update(skinny_us=t * 1e6, skinny_of_copy=nbytes / t / bw,
                           config=tlin.skinny_config(m, n, DTYPE.itemsize, silu))
                if sweep and m in (1, 16) and (model, layer) in SWEPT:
                    configs = [dict(cfg, BLOCK_M=16) for cfg in SKINNY_CONFIGS]
                    best = fastest(t, (
                        (cfg, partial(bench_graph_each,
                                      [partial(tlin.linear, x, w, config=cfg, **kwargs)
                                       for w in weights], 30))
                        for cfg in configs))
                    row.update(best_us=best[0] * 1e6, best_of_copy=nbytes / best[0] / bw,
                               best_config=best[1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _unfused(x, weight, silu: bool, residual):
    """What ``linear`` does past the skinny limit, at any row count: cuBLAS (the residual in its
    epilogue), then the activation kernel."""
    if residual is not None:
        return torch.addmm(residual, x, weight.t())
    y = torch.nn.functional.linear(x, weight)
    return tlin.silu_and_mul(y) if silu else y


# Qwen3-30B-A3B (Qwen3-Coder-30B-A3B's too), TP 1
MOE_SHAPE = dict(experts=128, top_k=8, hidden=2048, inter=768)
MOE_CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
               for bm, bn, bk, w, st in [(16, 32, 64, 4, 4), (16, 64, 128, 4, 3),
                                         (16, 128, 64, 4, 3), (32, 64, 64, 4, 4),
                                         (64, 64, 64, 4, 3), (64, 128, 64, 8, 3),
                                         (128, 128, 64, 8, 3)]]
MOE_FP8_CONFIGS = MOE_CONFIGS + [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_warps=w, num_stages=st)
    for bm, bn, w, st in [(16, 64, 4, 4), (32, 64, 4, 3), (64, 128, 8, 3), (64, 128, 4, 3),
                          (64, 64, 4, 4), (128, 128, 8, 3)]]
MOE_FP8_BLOCK = (128, 128)


def _expert_loop(x, w13, w2, plan):
    """The unfused baseline: per touched expert, its rows gathered, cuBLAS gate/up, SiLU-and-mul,
    cuBLAS down, scaled by the routing weights and added into the output."""
    out = torch.zeros_like(x)
    for expert, rows, weights in plan:
        act = tlin.silu_and_mul(torch.nn.functional.linear(x.index_select(0, rows), w13[expert]))
        out.index_add_(0, rows, torch.nn.functional.linear(act, w2[expert]) * weights)
    return out


def _fp8_experts(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert of w [E, N, K] quantized block-wise:
    (e4m3 [E, N, K], scales [E, N / bn, K / bk])."""
    from nanovllm.kernels.fp8_reference import quantize_fp8_block
    quantized = [quantize_fp8_block(w[e], block) for e in range(w.size(0))]
    return torch.stack([q for q, _ in quantized]), torch.stack([s for _, s in quantized])


def moe_rows(sweep: bool, bw: float, routings: int = 8):
    """The fused MoE kernel against the per-expert cuBLAS loop at Qwen3-30B-A3B's shapes (one
    layer), and the fp8 kernel on the same experts quantized block-wise, W8A8 (``fp8_*``) and
    W8A16 (``w8a16_*``)."""
    from nanovllm.kernels.fp8_reference import dequantize_fp8_block
    rows = []
    e, top_k, h, i = (MOE_SHAPE[name] for name in ("experts", "top_k", "hidden", "inter"))
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=DTYPE) / h ** 0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=DTYPE) / i ** 0.5
    expert_bytes = 3 * h * i * DTYPE.itemsize
    (q13, s13), (q2, s2) = _fp8_experts(w13, MOE_FP8_BLOCK), _fp8_experts(w2, MOE_FP8_BLOCK)
    fp8 = dict(w13_scale=s13, w2_scale=s2, block_shape=MOE_FP8_BLOCK)
    fp8_expert_bytes = (q13[0].numel() + q2[0].numel()) + 4 * (s13[0].numel() + s2[0].numel())
    dq13, dq2 = (dequantize_fp8_block(q, sc, MOE_FP8_BLOCK, DTYPE)
                 for q, sc in ((q13, s13), (q2, s2)))
    for m in (1, 16, 64, 256, 1024, 4096):
        x = torch.randn(m, h, device="cuda", dtype=DTYPE)
        logits = [torch.randn(m, e, device="cuda", dtype=DTYPE) for _ in range(routings)]
        routed = [tmoe.fused_topk(lg, top_k, True) for lg in logits]
        plans = []
        for weights, ids in routed:  # the loop's routing, found on the host before timing
            plan = []
            for expert in ids.unique().tolist():
                token, slot = torch.where(ids == expert)
                plan.append((expert, token, weights[token, slot].to(DTYPE).unsqueeze(1)))
            plans.append(plan)
        touched = sum(len(p) for p in plans) / routings
        nbytes = touched * expert_bytes
        fused = [partial(tmoe.fused_moe, x, w13, w2, w, ids) for w, ids in routed]
        t_fused = bench_graph_each(fused)
        t_layer = bench_graph_each([partial(_routed_moe, x, w13, w2, lg, top_k) for lg in logits])
        t_loop = bench_graph_each([partial(_expert_loop, x, w13, w2, plan) for plan in plans])
        ref = _expert_loop(x, w13, w2, plans[0]).float()
        err = float((fused[0]().float() - ref).norm() / ref.norm())
        row = dict(kind="moe", m=m, **MOE_SHAPE, experts_touched=touched, weight_mb=nbytes / 1e6,
                   fused_us=t_fused * 1e6, fused_of_copy=nbytes / t_fused / bw,
                   layer_us=t_layer * 1e6, loop_us=t_loop * 1e6, loop_of_copy=nbytes / t_loop / bw,
                   speedup=t_loop / t_fused, rel_err=err, config=tmoe.moe_config(m, e, top_k))
        fp8_bytes = touched * fp8_expert_bytes
        fused_fp8 = [partial(tmoe.fused_moe, x, q13, q2, w, ids, **fp8) for w, ids in routed]
        t_fp8 = bench_graph_each(fused_fp8)
        # cuBLAS on the experts dequantized to bf16
        ref_fp8 = _expert_loop(x, dq13, dq2, plans[0]).float()
        w8a16 = [partial(tmoe.fused_moe, x, q13, q2, w, ids, w8a8=False, **fp8)
                 for w, ids in routed]
        t_w8a16 = bench_graph_each(w8a16)
        row.update(fp8_weight_mb=fp8_bytes / 1e6, fp8_us=t_fp8 * 1e6,
                   fp8_of_copy=fp8_bytes / t_fp8 / bw, fp8_speedup=t_fused / t_fp8,
                   fp8_rel_err=float((fused_fp8[0]().float() - ref_fp8).norm() / ref_fp8.norm()),
                   w8a16_us=t_w8a16 * 1e6, w8a16_speedup=t_fused / t_w8a16,
                   w8a16_rel_err=float((w8a16[0]().float() - ref_fp8).norm() / ref_fp8.norm()))
        if sweep and m in (1, 64, 256, 4096):
            # (column prefix, its time with the default tiles, bytes read, the weights, the tiles,
            # keywords)
            routes = [("", t_fused, nbytes, (w13, w2), MOE_CONFIGS, {}),
                      ("fp8_", t_fp8, fp8_bytes, (q13, q2), MOE_FP8_CONFIGS, fp8),
                      ("w8a16_", t_w8a16, fp8_bytes, (q13, q2), MOE_FP8_CONFIGS,
                       dict(fp8, w8a8=False))]
            for prefix, t_default, route_bytes, weights, configs, kwargs in routes:
                best = fastest(t_default, (
                    (cfg, partial(bench_graph_each,
                                  [partial(tmoe.fused_moe, x, *weights, w, ids, config=cfg,
                                           **kwargs) for w, ids in routed], 30))
                    for cfg in configs))
                row.update({f"{prefix}best_us": best[0] * 1e6, f"{prefix}best_config": best[1],
                            f"{prefix}best_of_copy": route_bytes / best[0] / bw})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _routed_moe(x, w13, w2, logits, top_k: int):
    """The layer as the engine runs it from the router's logits: top-k, then the experts."""
    return tmoe.fused_moe(x, w13, w2, *tmoe.fused_topk(logits, top_k, True))


PREFILL_CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                   for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for s in (2, 3)]


def prefill_rows(flash, sweep: bool):
    rows = []
    cases = [(1, 8192, 0), (4, 2048, 0), (16, 1024, 0), (16, 512, 0), (1, 4096, 4096),
             (4, 1024, 1024), (16, 512, 512)]
    for num_seqs, new, cached in cases:
        total_k = cached + new
        k_cache, v_cache, tables = paged_kv([total_k] * num_seqs)
        n = num_seqs * new
        q = torch.randn(n, H, D, device="cuda", dtype=DTYPE)
        k = torch.randn(n, KVH, D, device="cuda", dtype=DTYPE)
        v = torch.randn(n, KVH, D, device="cuda", dtype=DTYPE)
        cu_q = torch.arange(0, n + 1, new, dtype=torch.int32, device="cuda")
        cu_k = torch.arange(0, num_seqs * total_k + 1, total_k, dtype=torch.int32, device="cuda")
        bt = tables if cached else None
        pairs = num_seqs * (new * cached + new * (new + 1) / 2)   # visible query-key pairs
        flops = 4 * H * D * pairs
        row = dict(kind="prefill", seqs=num_seqs, new=new, cached=cached)
        args = (q, k, v, k_cache, v_cache, cu_q, cu_k, new, bt, SCALE)
        t = bench(partial(ta.prefill_attention, *args))
        row.update(triton_ms=t * 1e3, triton_tflops=flops / t / 1e12)
        if sweep:
            best = fastest(t, ((cfg, partial(bench, partial(ta.prefill_attention, *args,
                                                            config=cfg), rep=30))
                               for cfg in PREFILL_CONFIGS))
            row.update(best_tflops=flops / best[0] / 1e12, best_config=best[1])
        if flash is not None:
            if cached:
                fn = partial(flash.flash_attn_varlen_func, q, k_cache, v_cache, cu_q, cu_k, new,
                             total_k, softmax_scale=SCALE, causal=True, block_table=tables)
            else:
                fn = partial(flash.flash_attn_varlen_func, q, k, v, cu_q, cu_q, new, new,
                             softmax_scale=SCALE, causal=True)
            tf = bench(fn)
            row.update(flash_ms=tf * 1e3, flash_tflops=flops / tf / 1e12)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def plot(rows: list[dict], path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    dec = [r for r in rows if r["kind"] == "decode"]
    labels = [f"{r['batch']}x{r['ctx']}" for r in dec]
    x = range(len(dec))
    a.bar([i - 0.2 for i in x], [r["triton_tbs"] for r in dec], 0.4, label="Triton (ours)")
    if "flash_tbs" in dec[0]:
        a.bar([i + 0.2 for i in x], [r["flash_tbs"] for r in dec], 0.4, label="flash-attn 2.8.3")
    a.axhline(rows[0]["copy_tbs"], color="k", ls="--", lw=1, label="device copy")
    a.set_xticks(list(x), labels, rotation=60, fontsize=8)
    a.set_ylabel("KV read TB/s")
    a.set_title("decode attention (batch x context)")
    a.legend(fontsize=8)
    pre = [r for r in rows if r["kind"] == "prefill"]
    labels = [f"{r['seqs']}x{r['new']}" + (f"+{r['cached']}" if r["cached"] else "") for r in pre]
    x = range(len(pre))
    b.bar([i - 0.2 for i in x], [r["triton_tflops"] for r in pre], 0.4, label="Triton (ours)")
    if "flash_tflops" in pre[0]:
        b.bar([i + 0.2 for i in x], [r["flash_tflops"] for r in pre], 0.4, label="flash-attn 2.8.3")
    b.set_xticks(list(x), labels, rotation=30, fontsize=8)
    b.set_ylabel("TFLOP/s")
    b.set_title("prefill attention (seqs x new tokens + cached)")
    b.legend(fontsize=8)
    fig.suptitle(f"{torch.cuda.get_device_name()}, bf16, 16 q / 8 kv heads, head_dim 128, "
                 f"page 256, {time.strftime('%Y-%m-%d')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--no-flash", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configurations")
    parser.add_argument("--only", choices=["attention", "decode", "linear", "moe"],
                        help="one group of benchmarks")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: the decode attention rows alone, over an e4m3 cache")
    parser.add_argument("--page", type=int, default=PAGE, help="the decode rows' page (block) size")
    args = parser.parse_args()
    fp8 = args.kv_cache_dtype == "fp8"
    os.makedirs(args.out, exist_ok=True)
    flash = None
    # flash-attn 2 has no fp8 cache
    if not args.no_flash and args.only not in ("linear", "moe") and not fp8:
        try:
            import flash_attn as flash
        except ImportError:
            sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))
            from flash_attn_build import load_flash_attn
            t = time.time()
            flash = load_flash_attn()
            print(f"built flash-attn in {time.time() - t:.0f} s", flush=True)
    bw = copy_bandwidth()
    print(f"device copy: {bw / 1e12:.2f} TB/s", flush=True)
    if fp8:
        rows = decode_rows(None, args.sweep, torch.float8_e4m3fn, args.page)
    elif args.only == "decode":
        rows = decode_rows(flash, args.sweep, DTYPE, args.page)
    else:
        rows = [] if args.only in ("linear", "moe") else (
            decode_rows(flash, args.sweep, DTYPE, args.page) + prefill_rows(flash, args.sweep))
        rows += [] if args.only in ("attention", "moe") else linear_rows(args.sweep, bw)
        rows += moe_rows(args.sweep, bw) if args.only in (None, "moe") else []
    for r in rows:
        r["copy_tbs"] = bw / 1e12
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    name = ("kernels_fp8" if fp8 else f"kernels{'_' + args.only if args.only else ''}") + (
        f"_page{args.page}" if args.page != PAGE else "")
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if args.only not in ("linear", "moe", "decode") and not fp8:
        plot(rows, os.path.join(args.out, "kernels.png"))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
