"""When cascade decode attention pays (issue 46's rule): one layer's decode attention over a batch
whose rows come in groups sharing a prefix, plain (each row reads the prefix) against the cascade
(each group's prefix read once, ``triton_attention.decode_attention(..., prefixes=...)``), at
Qwen3-0.6B's and -8B's attention shapes, batch 1-512, shared prefixes of 64-8,192 tokens, groups of
2 to the whole batch, each row with 128 tokens of its own. CUDA Graph replays; one JSON line a
point, then a table of the cascade's speed-up, its grid sized to the groups and as the engine's
CUDA graphs size it (MAX_GROUPS groups, the whole batch's rows; "nan" past MAX_GROUPS groups).

    python tools/bench_cascade.py [--out DIR] [--quick] [--models 0.6b 8b] [--parts 1 2 4 8 16]
        [--batches 1 64 ...] [--no-scenarios]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from bench_kernels import bench_graph_each  # noqa: E402

from nanovllm.kernels import triton_attention as ta  # noqa: E402
from nanovllm.kernels.cascade_reference import (  # noqa: E402
    MAX_GROUPS,
    as_shared_prefixes,
    shared_prefix_groups,
)

SHAPES = {"0.6b": (16, 8, 128), "8b": (32, 8, 128)}  # heads, KV heads, head dim
PAGE = 64
OWN = 128  # each row's tokens past the prefix


# bench.py's scenarios at a mid-decode step (batch, group, shared, own tokens): `prefix` (256
# requests of a 2,048-token prefix), `rl` (64 prompts x n = 8: 448 shared, the last prompt block
# each completion's own)
SCENARIO_POINTS = {"prefix": (256, 256, 2048, 128), "rl": (512, 8, 448, 320)}


def batch_of_groups(batch: int, group: int, shared: int, kv_heads: int, head_dim: int,
                    own: int = OWN, dtype=torch.bfloat16):
    """Caches and tables for ``batch`` rows in groups of ``group`` sharing ``shared`` tokens, each
    with ``own`` more."""
    shared_pages, own_pages = shared // PAGE, -(-(own + 1) // PAGE)
    groups = -(-batch // group)
    total = groups * shared_pages + batch * own_pages
    k_cache = torch.randn(total, PAGE, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(total).tolist()
    tables, used = [], 0
    for g in range(groups):
        prefix = order[used:used + shared_pages]
        used += shared_pages
        for _ in range(min(group, batch - g * group)):
            tables.append(prefix + order[used:used + own_pages])
            used += own_pages
    lens = [shared + own + 1] * batch
    bt = torch.tensor(tables, dtype=torch.int32, device="cuda")
    groups = shared_prefix_groups(tables, lens, PAGE)
    prefixes = as_shared_prefixes(groups, batch, PAGE, "cuda")
    # as the engine's CUDA graphs hold them: MAX_GROUPS groups, the grid sized for the whole batch
    captured = (as_shared_prefixes(groups, batch, PAGE, "cuda", capacity=MAX_GROUPS)
                if len(groups) <= MAX_GROUPS else None)
    return (k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32, device="cuda"), prefixes,
            captured)


def kernel_times(fn, reps: int = 20) -> dict:
    """The cascade's kernels one by one (torch.profiler, eager launches): µs a call each."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.self_device_time_total / reps, 2) for e in prof.key_averages()
            if e.self_device_time_total > 0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true", help="fewer points (a first look)")
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--parts", nargs="*", type=int, default=[],
                        help="also time the cascade with each of these prefix_parts (the shared "
                             "keys' ranges), to choose the rule's")
    parser.add_argument("--batches", nargs="+", type=int, help="these batches only")
    parser.add_argument("--no-scenarios", action="store_true", help="leave the scenario points out")
    args = parser.parse_args()
    batches = args.batches or ((1, 8, 64, 256) if args.quick else (1, 4, 16, 64, 256, 512))
    shareds = (64, 256, 2048) if args.quick else (64, 256, 1024, 2048, 8192)
    points = ([] if args.no_scenarios else
              [(*point, name) for name, point in SCENARIO_POINTS.items()])
    points += [(batch, group, shared, OWN, None)
               for batch, shared in itertools.product(batches, shareds)
               for group in sorted({g for g in (2, 8, 64, batch) if g <= batch and g > 1})]
    rows = []
    for model in args.models:
        heads, kv_heads, d = SHAPES[model]
        for batch, group, shared, own, scenario in points:
            k_cache, v_cache, bt, ctx, prefixes, captured = batch_of_groups(
                batch, group, shared, kv_heads, d, own)
            q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
            plain_fn = partial(ta.decode_attention, q, k_cache, v_cache, ctx, bt, d ** -0.5)
            cascade_fn = partial(plain_fn, prefixes=prefixes)
            plain = bench_graph_each([plain_fn] * 4)
            cascade = bench_graph_each([cascade_fn] * 4)
            graph = (bench_graph_each([partial(plain_fn, prefixes=captured)] * 4)
                     if captured is not None else float("nan"))
            parts_us = {p: bench_graph_each([partial(cascade_fn, prefix_parts=p)] * 4) * 1e6
                        for p in args.parts}
            ref, got = plain_fn().float(), cascade_fn().float()
            kernels = kernel_times(cascade_fn) if scenario else None
            row = dict(model=model, scenario=scenario, batch=batch, group=group,
                       shared=shared, own=own,
                       saved_tokens=(batch - -(-batch // group)) * shared,
                       plain_us=plain * 1e6, cascade_us=cascade * 1e6,
                       speedup=plain / cascade,
                       engine_us=graph * 1e6,
                       engine_speedup=plain / graph, parts_us=parts_us,
                       best_parts=min(parts_us, key=parts_us.get) if parts_us else None,
                       rel_err=float((got - ref).norm() / ref.norm()),
                       kernels_us=kernels)
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(meta))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cascade.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f)
    print("| model | batch | group | shared | plain µs | cascade µs | speed-up | engine's µs | "
          "speed-up | best prefix_parts (µs) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = (f"{r['best_parts']} ({r['parts_us'][r['best_parts']]:.1f})"
                if r["best_parts"] else "")
        name = f"{r['model']} {r['scenario']}" if r["scenario"] else r["model"]
        print(f"| {name} | {r['batch']} | {r['group']} | {r['shared']} | "
              f"{r['plain_us']:.1f} | {r['cascade_us']:.1f} | {r['speedup']:.2f} | "
              f"{r['engine_us']:.1f} | {r['engine_speedup']:.2f} | {best} |")


if __name__ == "__main__":
    main()
