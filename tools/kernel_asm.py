"""The attention, fp8 GEMM and fused MoE kernels compiled for an H200 (sm_90) on any machine, no GPU
needed: counts of the PTX instructions that tell how tiles move (byte-wise shared-memory traffic,
ldmatrix, fp8 conversions, the tensor-core products), and each kernel's shared memory. Triton's
wheel carries the compiler; the kernels must be real JIT functions, so TRITON_INTERPRET must be
unset (the script refuses otherwise).

    python tools/kernel_asm.py [--json] [--ptx-dir DIR]

What it showed: over an fp8 cache, Triton moved V's e4m3 -> fp16 conversion after V's shuffle into
the P @ V operand layout, so the 8-bit tile crossed shared memory a byte at a time (128 ld.shared.b8
and st.shared.b8 per 128-key tile, no ldmatrix); multiplying the tile by v_scale first keeps the
conversion before the shuffle (ldmatrix on fp16, as with a bf16 cache).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PATTERNS = {"ld.shared.b8": r"ld\.shared\.b8", "st.shared.b8": r"st\.shared\.b8",
            "ldmatrix": r"\bldmatrix", "cvt.e4m3x2": r"e4m3x2", "mma.sync": r"\bmma\.sync",
            "wgmma": r"\bwgmma\.mma_async", "cp.async": r"\bcp\.async\.(?:ca|cg)",
            "tma": r"cp\.async\.bulk\.tensor"}


def _compile(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
             unaligned=("m", "stride_bt")):
    """``fn`` compiled as a launch would compile it: pointers and integer arguments (but
    ``unaligned``, those a launch may pass unaligned or that are not specialized) marked divisible
    by 16, as Triton marks them when they are; without that mark the loads are not vectorized."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, kind in signature.items()
             if name not in unaligned and (kind.startswith("*") or kind in ("i32", "i64"))}
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    options = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def _registers(ptx: str) -> int | None:
    """Registers a thread, from ptxas (the one in Triton's wheel) on the PTX; None when it cannot
    run."""
    import subprocess
    import tempfile

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
    found = re.search(r"Used (\d+) registers", run.stderr)
    return int(found.group(1)) if found else None


def decode(kv: str, block_n: int = 128, num_warps: int = 4):
    """The decode kernel at Qwen3-0.6B's shapes (2 query heads a KV head, head_dim 128,
    pages of 256)."""
    from nanovllm.kernels import triton_attention as ta
    fp8 = kv == "fp8e4nv"
    sig = {"q_ptr": "*bf16", "k_cache_ptr": f"*{kv}", "v_cache_ptr": f"*{kv}", "bt_ptr": "*i32",
           "ctx_ptr": "*i32", "o_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
           "qk_scale": "fp32", "v_scale": "fp32", "stride_qb": "i32", "stride_qh": "i32",
           "stride_bt": "i32", "stride_ob": "i32", "stride_oh": "i32"}
    const = dict(GROUP=2, BLOCK_G=16, NUM_KV_HEADS=8, HEAD_DIM=128, PAGE=256, BLOCK_N=block_n,
                 NUM_SPLITS=1, PRECISION="tf32", WINDOW=0, FP8=fp8, Q_FP16=fp8)
    return _compile(ta._decode_kernel, sig, const, num_warps, 3)


def cascade(kv: str, block_m: int = 64):
    """The cascade's kernel at the same shapes: its shared-prefix programs (``block_m``
    (sequence, query head) pairs of a group against its shared blocks) and its suffix
    programs (each row's keys past its shared prefix)."""
    from nanovllm.kernels import triton_attention as ta
    fp8 = kv == "fp8e4nv"
    sig = {"q_ptr": "*bf16", "k_cache_ptr": f"*{kv}", "v_cache_ptr": f"*{kv}", "bt_ptr": "*i32",
           "ctx_ptr": "*i32", "start_ptr": "*i32", "first_row_ptr": "*i32",
           "num_rows_ptr": "*i32", "shared_ptr": "*i32", "part_o_ptr": "*fp32",
           "part_lse_ptr": "*fp32", "qk_scale": "fp32", "v_scale": "fp32", "stride_qb": "i32",
           "stride_qh": "i32", "stride_bt": "i32", "num_groups": "i32", "prefix_programs": "i32"}
    const = dict(GROUP=2, BLOCK_G=16, NUM_KV_HEADS=8, HEAD_DIM=128, PAGE=256, BLOCK_N=64,
                 NUM_SPLITS=1, BLOCK_M=block_m, PREFIX_BLOCK_N=64, PREFIX_PARTS=4, GROUPS_P2=64,
                 PRECISION="tf32", FP8=fp8, Q_FP16=fp8)
    return _compile(ta._cascade_kernel, sig, const, 4, 3)


def prefill(kv: str):
    """The paged prefill kernel (a cached prefix, chunks) at the same shapes, with its long-prompt
    tiles."""
    from nanovllm.kernels import triton_attention as ta
    fp8 = kv == "fp8e4nv"
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": f"*{kv}",
           "v_cache_ptr": f"*{kv}", "o_ptr": "*bf16", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32",
           "bt_ptr": "*i32", "qk_scale": "fp32", "v_scale": "fp32", "stride_qt": "i32",
           "stride_qh": "i32", "stride_kt": "i32", "stride_vt": "i32", "stride_ot": "i32",
           "stride_oh": "i32", "stride_bt": "i32"}
    const = dict(GROUP=2, NUM_KV_HEADS=8, HEAD_DIM=128, PAGE=256, PAGED=True, BLOCK_M=128,
                 BLOCK_N=128, PRECISION="tf32", WINDOW=0, FP8=fp8, Q_FP16=fp8)
    return _compile(ta._prefill_kernel, sig, const, 8, 3)


def fp8_gemm(block: bool, block_m: int = 128, block_n: int = 128):
    """The fp8 GEMM (prefill, decode batches over 16 rows) with block-wise or per-channel scales."""
    from nanovllm.kernels import triton_fp8 as tf
    sig = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
           "b_ptr": "*bf16", "res_ptr": "*bf16", "y_ptr": "*bf16", "m": "i32", "n": "i32",
           "k": "i32", "stride_a": "i32", "stride_as": "i32", "stride_w": "i32", "stride_ws": "i32",
           "stride_r": "i32", "stride_y": "i32"}
    cfg = tf.gemm_config(block_m, 1 << 20)
    cfg.update(BLOCK_M=block_m, BLOCK_N=block_n)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    const = dict(SCALE_N=128 if block else 1, SCALE_K=128 if block else 4096, PER_CHANNEL=not block,
                 BIAS=False, RESIDUAL=False, **cfg)
    return _compile(tf._fp8_gemm_kernel, sig, const, warps, stages, unaligned=("m", "stride_as"))


def fp8_skinny(split: bool, silu_mul: bool = True, block_n: int = 32, block_k: int = 512,
               num_warps: int = 4, num_stages: int = 3):
    """The skinny fp8 linear (decode, up to 16 rows; x quantized before it) with block-wise scales,
    whole or split over K (the atomics of the split's sums)."""
    from nanovllm.kernels import triton_fp8 as tf
    sig = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
           "b_ptr": "*bf16", "res_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
           "count_ptr": "*i32", "m": "i32", "k": "i32", "n": "i32", "split_k": "i32",
           "stride_x": "i32", "stride_xs": "i32", "stride_w": "i32", "stride_s": "i32",
           "stride_r": "i32", "stride_y": "i32"}
    const = dict(SCALE_N=128, SCALE_K=128, PER_CHANNEL=False, SILU_MUL=silu_mul, BIAS=False,
                 RESIDUAL=not silu_mul, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, CHUNK_K=128,
                 SPLIT=split, FP8_DOT=True, PRECISION="ieee")
    return _compile(tf._fp8_skinny_kernel, sig, const, num_warps, num_stages,
                    unaligned=("m", "split_k", "stride_s"))

def moe(fp8: bool, block_m: int, w8a8: bool = False):
    """The fused MoE's gate/up GEMM (SiLU-and-mul) at Qwen3-30B-A3B's shapes, bf16 experts or
    block-wise fp8 ones (128x128 blocks; x in bf16, or ``w8a8``: x in e4m3 with its scales), with
    ``moe_config``'s tiles for BLOCK_M ``block_m`` (16: decode, 64: prefill)."""
    from nanovllm.kernels import triton_moe as tm
    sig = {"a_ptr": "*fp8e4nv" if w8a8 else "*bf16", "as_ptr": "*fp32",
           "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "s_ptr": "*fp32",
           "c_ptr": "*bf16", "topk_weights_ptr": "*fp32", "sorted_ids_ptr": "*i32",
           "expert_ids_ptr": "*i32", "num_post_padded_ptr": "*i32", "n": "i32", "k": "i32",
           "num_pairs": "i32", "stride_a": "i32", "stride_as": "i32", "stride_we": "i32",
           "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_c": "i32"}
    cfg = tm.moe_config({16: 1, 64: 1 << 20}[block_m], 128, 8, (128, 128) if fp8 else None)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    const = dict(ROWS_PER_A=8, SILU_MUL=True, MUL_ROUTED_WEIGHT=False, FP8_W=fp8, FP8_A=w8a8,
                 SCALE_N=128 if fp8 else 1, SCALE_K=128 if fp8 else 1, PRECISION="tf32", **cfg)
    return _compile(tm._fused_moe_kernel, sig, const, warps, stages,
                    unaligned=("num_pairs", "stride_as", "stride_se", "stride_sn"))


KERNELS = {"fp8 GEMM block-wise": lambda: fp8_gemm(True),
           "fp8 GEMM per-channel": lambda: fp8_gemm(False),
           "fp8 GEMM block-wise 64x64": lambda: fp8_gemm(True, 64, 64),
           "fp8 skinny gate/up": lambda: fp8_skinny(False),
           "fp8 skinny gate/up, split over K": lambda: fp8_skinny(True),
           "fp8 skinny down, split over K": lambda: fp8_skinny(True, False),
           "decode bf16": lambda: decode("bf16"), "decode fp8": lambda: decode("fp8e4nv"),
           "decode fp8, 64-key tiles": lambda: decode("fp8e4nv", 64),
           "cascade bf16, 64 pairs": lambda: cascade("bf16"),
           "cascade bf16, 16 pairs": lambda: cascade("bf16", 16),
           "cascade fp8, 64 pairs": lambda: cascade("fp8e4nv"),
           "prefill paged bf16": lambda: prefill("bf16"),
           "prefill paged fp8": lambda: prefill("fp8e4nv"),
           "MoE gate/up bf16, 16 rows": lambda: moe(False, 16),
           "MoE gate/up fp8, 16 rows": lambda: moe(True, 16),
           "MoE gate/up bf16, 64 rows": lambda: moe(False, 64),
           "MoE gate/up fp8, 64 rows": lambda: moe(True, 64),
           "MoE gate/up fp8 W8A8, 16 rows": lambda: moe(True, 16, True),
           "MoE gate/up fp8 W8A8, 64 rows": lambda: moe(True, 64, True)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--ptx-dir", help="also write each kernel's PTX and TTGIR there")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    rows = {}
    for name, build in KERNELS.items():
        kernel = build()
        ptx = kernel.asm["ptx"]
        rows[name] = {key: len(re.findall(pattern, ptx)) for key, pattern in PATTERNS.items()}
        rows[name]["shared_bytes"] = kernel.metadata.shared
        rows[name]["registers"] = _registers(ptx)
        if args.ptx_dir:
            os.makedirs(args.ptx_dir, exist_ok=True)
            stem = os.path.join(args.ptx_dir, name.replace(" ", "_").replace(",", ""))
            for ext in ("ptx", "ttgir"):
                with open(f"{stem}.{ext}", "w") as f:
                    f.write(kernel.asm[ext])
    if args.json:
        print(json.dumps(rows))
        return
    keys = list(PATTERNS) + ["shared_bytes", "registers"]
    print("| kernel | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
