"""fp8 weights' linear layers on one GPU against bf16's, same shapes, same run: Qwen3-0.6B's
and -8B's projections at 1-8192 rows, each timed as the engine runs it (CUDA Graph replays of
back-to-back calls over enough copies of the weight that L2 holds none of them when it comes round
again).

Columns: ``bf16_us`` (the skinny kernel up to 16 rows, else cuBLAS), ``block_us`` (a block-wise
128x128 fp8 checkpoint's weight: the skinny fp8 kernel, or activation quantization plus the fp8
tensor-core GEMM), ``channel_us`` (``quantization="fp8"``'s per-channel weight, activations
quantized per token); past 16 rows each route apart, unfused: ``block_triton_us`` /
``channel_triton_us`` (our GEMM), ``block_scaled_mm_us`` / ``scaled_mm_us`` (cuBLAS's,
``triton_fp8.scaled_mm``, the same quantization), then weight bytes read per
second (``*_tbs``) and TFLOP/s. ``--sweep``: the fastest other tiles for some rows and layers.

    python tools/bench_fp8.py [--out DIR] [--sweep]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from functools import partial

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from bench_kernels import LINEAR_SHAPES, bench_graph_each, copy_bandwidth, fastest  # noqa: E402

from nanovllm.kernels import triton_fp8 as tf  # noqa: E402
from nanovllm.kernels import triton_linear as tlin  # noqa: E402
from nanovllm.kernels.fp8_reference import quantize_fp8_block, quantize_fp8_per_channel  # noqa: E402

ROWS = (1, 4, 16, 32, 64, 128, 256, 1024, 8192)
GEMM_CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w, num_stages=st)
                for bm, bn, w, st in [(64, 64, 4, 4), (64, 128, 4, 4), (64, 256, 8, 3),
                                      (128, 64, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4),
                                      (128, 256, 8, 3)]]
SKINNY_CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
                  for bn, bk, w, st in [(16, 512, 4, 3), (16, 1024, 4, 2), (32, 256, 4, 4),
                                        (32, 512, 4, 4), (32, 1024, 8, 2), (64, 512, 8, 3)]]


def _weights(n: int, k: int, copies: int):
    """(bf16, block-wise fp8 and its scales, per-channel fp8 and its scales) per copy."""
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        out.append((w, *quantize_fp8_block(w), *quantize_fp8_per_channel(w)))
    return out


def _sweep(m: int, x, weights, kwargs) -> dict:
    """The fastest tiles for the block-wise weight at m rows (the skinny kernel's, or the
    GEMM's)."""
    skinny = m <= tlin.SKINNY_MAX_M
    configs = SKINNY_CONFIGS if skinny else GEMM_CONFIGS

    def time_it(cfg):
        if skinny:
            return bench_graph_each([partial(tf.fp8_skinny, x, wb, sb, (128, 128), None,
                                             kwargs["residual"], kwargs["silu_mul"], config=cfg)
                                     for _, wb, sb, _, _ in weights], 30)
        return bench_graph_each([partial(tf.fp8_gemm, x, wb, sb, (128, 128), None, None, config=cfg)
                                 for _, wb, sb, _, _ in weights], 30)
    best = fastest(float("inf"), ((cfg, partial(time_it, cfg)) for cfg in configs))
    return dict(best_block_us=best[0] * 1e6, best_config=best[1])


def rows_of(model, layer, k, n, fusion, bw: float, sweep: bool) -> list[dict]:
    silu = fusion == "silu"
    n_all = (2 if silu else 1) * n
    nbytes = n_all * k * 2
    weights = _weights(n_all, k, max(4, triton.cdiv(200 * 2 ** 20, nbytes)))
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(m, n, device="cuda",
                               dtype=torch.bfloat16) if fusion == "residual" else None
        kwargs = dict(silu_mul=silu, residual=residual)
        row = dict(kind="fp8_linear", model=model, layer=layer, k=k, n=n, fusion=fusion, m=m,
                   bf16_mb=nbytes / 1e6)
        times = dict(
            bf16=bench_graph_each([partial(tlin.linear, x, w, **kwargs) for w, *_ in weights]),
            block=bench_graph_each([partial(tf.fp8_linear, x, wb, sb, (128, 128), **kwargs)
                                    for _, wb, sb, _, _ in weights]),
            channel=bench_graph_each([partial(tf.fp8_linear, x, wc, sc, None, **kwargs)
                                      for *_, wc, sc in weights]))
        if m <= tlin.SKINNY_MAX_M:
            # the skinny kernel with both operands converted to bf16 instead of the fp8 MMA
            times["block_bf16mma"] = bench_graph_each([partial(tf.fp8_skinny, x, wb, sb, (128, 128),
                                                               None, residual, silu, fp8_dot=False)
                                                       for _, wb, sb, _, _ in weights])
        if m > tlin.SKINNY_MAX_M:
            # each route past the skinny kernel, unfused: our GEMM and cuBLAS's
            times["block_triton"] = bench_graph_each([
                partial(tf.fp8_gemm, x, wb, sb, (128, 128), None, None)
                for _, wb, sb, _, _ in weights])
            times["channel_triton"] = bench_graph_each([partial(tf.fp8_gemm, x, wc, sc, None,
                                                                None, None)
                                                        for *_, wc, sc in weights])
            try:
                times["block_scaled_mm"] = bench_graph_each([
                    partial(tf.scaled_mm, x, wb, sb, (128, 128)) for _, wb, sb, _, _ in weights])
                times["scaled_mm"] = bench_graph_each([partial(tf.scaled_mm, x, wc, sc, None)
                                                       for *_, wc, sc in weights])
            except Exception as e:  # an older torch or GPU without block-wise or row-wise scales
                print("scaled_mm:", repr(e)[:120], file=sys.stderr)
        for name, t in times.items():
            row[f"{name}_us"] = round(t * 1e6, 2)
            row[f"{name}_tbs"] = round(nbytes / (1 if name == "bf16" else 2) / t / 1e12, 3)
            row[f"{name}_tflops"] = round(2 * m * n_all * k / t / 1e12, 1)
        row["block_speedup"] = round(times["bf16"] / times["block"], 3)
        row["channel_speedup"] = round(times["bf16"] / times["channel"], 3)
        if (sweep and m in (1, 16, 64, 256, 8192) and layer in ("gate_up_proj", "down_proj")
                and model == "8b"):
            row.update(_sweep(m, x, weights, kwargs))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


SKINNY_TILES = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
                for bn, bk, w, st in [(16, 512, 4, 3), (16, 256, 4, 4),  # more programs, no split
                                      (32, 512, 4, 3), (32, 256, 4, 4), (64, 128, 4, 4),
                                      (64, 256, 4, 3), (64, 256, 4, 4), (64, 512, 8, 2),
                                      (128, 256, 8, 2)]]
SPLITS = (1, 2, 4, 6, 8)


def skinny_sweep(bw: float) -> list[dict]:
    """The skinny fp8 kernel (block-wise 128x128, 8B's projections, 1 and 16 rows) at every tile of
    SKINNY_TILES split over K in SPLITS slices, each checked against the unsplit default's output
    (a race would move it) and timed as the engine runs it; with bf16's skinny kernel beside."""
    rows = []
    for model, layer, k, n, fusion in LINEAR_SHAPES:
        if model != "8b" or layer == "lm_head":
            continue
        silu = fusion == "silu"
        n_all = (2 if silu else 1) * n
        weights = _weights(n_all, k, max(4, triton.cdiv(200 * 2 ** 20, n_all * k * 2)))
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(m, n, device="cuda",
                                   dtype=torch.bfloat16) if fusion == "residual" else None

            def call(w, s, cfg=None, res=None, x=x, silu=silu):  # res: added into in place
                return tf.fp8_skinny(x, w, s, (128, 128), None, res, silu, config=cfg)

            pristine = None if residual is None else residual.clone()  # timings add into residual

            def fresh(res=pristine):
                return None if res is None else res.clone()
            base = dict(model=model, layer=layer, k=k, n=n, m=m, fp8_mb=n_all * k / 1e6)
            bf16 = bench_graph_each([partial(tlin.linear, x, w, silu_mul=silu, residual=residual)
                                     for w, *_ in weights], 30)
            ref = call(*weights[0][1:3], None, fresh()).float()
            for tile in SKINNY_TILES:
                for split in SPLITS:
                    cfg = dict(tile, SPLIT_K=split)
                    row = dict(base, **cfg, bf16_us=round(bf16 * 1e6, 2))
                    try:
                        errs = [float((call(*weights[0][1:3], cfg, fresh()).float() - ref).norm()
                                      / ref.norm()) for _ in range(3)]
                        t = bench_graph_each([partial(call, wb, sb, cfg, residual)
                                              for _, wb, sb, _, _ in weights], 30)
                    except Exception as e:  # too much shared memory
                        print("skip", cfg, repr(e)[:80], file=sys.stderr)
                        continue
                    row.update(us=round(t * 1e6, 2), fp8_tbs=round(n_all * k / t / 1e12, 3),
                               of_copy=round(n_all * k / t / bw, 3), max_rel_err=max(errs),
                               speedup=round(bf16 / t, 3))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--sweep", action="store_true", help="also time other tiles")
    parser.add_argument("--skinny-sweep", action="store_true",
                        help="only the skinny kernel's tiles and splits over K (8B, 1 and 16 rows)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    print(f"device copy: {bw / 1e12:.2f} TB/s", flush=True)
    if args.skinny_sweep:
        rows = skinny_sweep(bw)
        with open(os.path.join(args.out, "fp8_skinny_sweep.json"), "w") as f:
            json.dump(dict(copy_tbs=bw / 1e12, gpu=torch.cuda.get_device_name(), rows=rows,
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), f)
        for (layer, m), group in itertools.groupby(rows, key=lambda r: (r["layer"], r["m"])):
            group = list(group)
            best = min(group, key=lambda r: r["us"])
            rule = tf.skinny_config(best["n"], best["k"],
                                    torch.cuda.get_device_properties(0).multi_processor_count)
            now = next((r["us"] for r in group if all(r[key] == v for key, v in rule.items())),
                       float("nan"))  # the engine's choice, when the sweep has it
            tile = {k: best[k] for k in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages",
                                         "SPLIT_K")}
            print(f"{layer:13s} m={m:2d} bf16 {best['bf16_us']:7.2f} us | rule {now:7.2f} | "
                  f"best {best['us']:7.2f} ({best['of_copy']:.0%} of copy) {tile} "
                  f"max err {max(r['max_rel_err'] for r in group):.1e}")
        return
    rows = [row for shape in LINEAR_SHAPES if shape[1] != "lm_head"
            for row in rows_of(*shape, bw, args.sweep)]
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, copy_tbs=bw / 1e12,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    with open(os.path.join(args.out, "fp8_linear.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
