"""The attention kernels compiled for an H200 (sm_90) on any machine, no GPU needed: counts of the PTX
instructions that tell how tiles move (byte-wise shared-memory traffic, ldmatrix, fp8 conversions, the
tensor-core products), and each kernel's shared memory. Triton's wheel carries the compiler; the kernels must
be real JIT functions, so TRITON_INTERPRET must be unset (the script refuses otherwise).

    python tools/kernel_asm.py [--json] [--ptx-dir DIR]

Seen this way (2026-12-01): over an fp8 cache, Triton moved V's e4m3 -> fp16 conversion after V's shuffle into
the P @ V operand layout, so the 8-bit tile crossed shared memory a byte at a time (128 ld.shared.b8 and
st.shared.b8 per 128-key tile, no ldmatrix); multiplying the tile by v_scale first keeps the conversion before
the shuffle (ldmatrix on fp16, as with a bf16 cache).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PATTERNS = {"ld.shared.b8": r"ld\.shared\.b8", "st.shared.b8": r"st\.shared\.b8", "ldmatrix": r"\bldmatrix",
            "cvt.e4m3x2": r"e4m3x2", "mma.sync": r"\bmma\.sync", "wgmma": r"\bwgmma\.mma_async",
            "cp.async": r"\bcp\.async\.(?:ca|cg)", "griddepcontrol.wait": r"griddepcontrol\.wait",
            "launch_dependents": r"griddepcontrol\.launch_dependents", "prefetch.L2": r"prefetch\.global\.L2"}


def _compile(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, unaligned=("m", "stride_bt")):
    """``fn`` compiled as a launch would compile it: pointers and integer arguments (but ``unaligned``, those a
    launch may pass unaligned or that are not specialized) marked divisible by 16, as Triton marks them when they
    are; without that mark the loads are not vectorized."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    constexprs = {"PDL": 0, **constexprs} if "PDL" in fn.arg_names else constexprs
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
             if name not in unaligned and (kind.startswith("*") or kind in ("i32", "i64"))}
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    options = dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=bool(constexprs.get("PDL")))
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def skinny(pdl: bool, silu_mul: bool = True, residual: bool = False):
    """The skinny linear kernel at one row, Qwen3-0.6B's gate_up (K 1,024, 2 x 3,072 columns) or o_proj + residual
    (K 2,048, 1,024 columns), with or without programmatic dependent launch (its weight prefetched into L2; the
    "pdl" rows here are PDL mode 2, the next kernel let in before the last stores)."""
    from nanovllm.kernels import triton_linear as tlin
    k = 2048 if residual else 1024
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "res_ptr": "*bf16", "y_ptr": "*bf16", "m": "i32",
           "k": "i32", "n": "i32", "stride_x": "i32", "stride_w": "i32", "stride_r": "i32", "stride_y": "i32"}
    cfg = tlin.skinny_config(1, 1024 if residual else 3072, 2, silu_mul)
    const = dict(SILU_MUL=silu_mul, BIAS=False, RESIDUAL=residual, PRECISION="tf32", PDL=2 if pdl else 0,
                 PREFETCH_LINES=k // 64 if pdl else 0, LINE=64,
                 **{key: v for key, v in cfg.items() if key.startswith("BLOCK")})
    return _compile(tlin._skinny_linear_kernel, sig, const, cfg["num_warps"], cfg["num_stages"])


def small(name: str, pdl: bool):
    """The RMSNorm, the attention prologue or the split-K merge of a decode layer, Qwen3-0.6B's shapes."""
    from nanovllm.kernels import triton_attention as ta
    from nanovllm.kernels import triton_linear as tlin
    if name == "rms_norm":
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32", "stride_o": "i32",
               "n": "i32", "eps": "fp32"}
        return _compile(tlin._rms_norm_kernel, sig, dict(BLOCK=1024, PDL=2 if pdl else 0), 4, 1)
    if name == "merge":
        sig = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "o_ptr": "*bf16", "stride_ob": "i32",
               "stride_oh": "i32"}
        return _compile(ta._merge_kernel, sig, dict(NUM_HEADS=16, HEAD_DIM=128, NUM_SPLITS=16, BLOCK_S=16,
                                                    PDL=2 if pdl else 0), 4, 1)
    sig = {"qkv_ptr": "*bf16", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "q_weight_ptr": "*bf16",
           "k_weight_ptr": "*bf16", "slot_ptr": "*i64", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
           "stride_t": "i32", "eps": "fp32", "inv_k_scale": "fp32", "inv_v_scale": "fp32"}
    const = dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=32, BLOCK_KV=8, NORM=True, FP8=False,
                 ROUND_FP8=False, PDL=2 if pdl else 0)
    return _compile(ta._qk_norm_rope_store_kernel, sig, const, 4, 1)


def decode(kv: str, block_n: int = 128, num_warps: int = 4, pdl: bool = False):
    """The decode kernel at Qwen3-0.6B's shapes (2 query heads a KV head, head_dim 128, pages of 256)."""
    from nanovllm.kernels import triton_attention as ta
    fp8 = kv == "fp8e4nv"
    sig = {"q_ptr": "*bf16", "k_cache_ptr": f"*{kv}", "v_cache_ptr": f"*{kv}", "bt_ptr": "*i32", "ctx_ptr": "*i32",
           "o_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32", "v_scale": "fp32",
           "stride_qb": "i32", "stride_qh": "i32", "stride_bt": "i32", "stride_ob": "i32", "stride_oh": "i32"}
    const = dict(GROUP=2, BLOCK_G=16, NUM_KV_HEADS=8, HEAD_DIM=128, PAGE=256, BLOCK_N=block_n, NUM_SPLITS=1,
                 PRECISION="tf32", WINDOW=0, FP8=fp8, Q_FP16=fp8, PDL=2 if pdl else 0)
    return _compile(ta._decode_kernel, sig, const, num_warps, 3)


def prefill(kv: str):
    """The paged prefill kernel (a cached prefix, chunks) at the same shapes, with its long-prompt tiles."""
    from nanovllm.kernels import triton_attention as ta
    fp8 = kv == "fp8e4nv"
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": f"*{kv}", "v_cache_ptr": f"*{kv}",
           "o_ptr": "*bf16", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "bt_ptr": "*i32", "qk_scale": "fp32",
           "v_scale": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_kt": "i32", "stride_vt": "i32",
           "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32"}
    const = dict(GROUP=2, NUM_KV_HEADS=8, HEAD_DIM=128, PAGE=256, PAGED=True, BLOCK_M=128, BLOCK_N=128,
                 PRECISION="tf32", WINDOW=0, FP8=fp8, Q_FP16=fp8)
    return _compile(ta._prefill_kernel, sig, const, 8, 3)


KERNELS = {"decode bf16": lambda: decode("bf16"), "decode fp8": lambda: decode("fp8e4nv"),
           "decode fp8, 64-key tiles": lambda: decode("fp8e4nv", 64), "prefill paged bf16": lambda: prefill("bf16"),
           "prefill paged fp8": lambda: prefill("fp8e4nv"), "decode bf16 pdl": lambda: decode("bf16", pdl=True),
           "skinny gate_up": lambda: skinny(False), "skinny gate_up pdl": lambda: skinny(True),
           "skinny o_proj pdl": lambda: skinny(True, silu_mul=False, residual=True),
           **{f"{name} pdl": (lambda name=name: small(name, True)) for name in ("rms_norm", "merge", "qk_norm_rope")}}


def loads_before_wait(ptx: str) -> int:
    """Global loads (plain or asynchronous) in the PTX before its first griddepcontrol.wait (-1: no wait)."""
    at = ptx.find("griddepcontrol.wait")
    return -1 if at < 0 else len(re.findall(r"\bld\.global|\bcp\.async\.c[ag]", ptx[:at]))


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
        rows[name]["loads_before_wait"] = loads_before_wait(ptx)
        if args.ptx_dir:
            os.makedirs(args.ptx_dir, exist_ok=True)
            stem = os.path.join(args.ptx_dir, name.replace(" ", "_").replace(",", ""))
            for ext in ("ptx", "ttgir"):
                with open(f"{stem}.{ext}", "w") as f:
                    f.write(kernel.asm[ext])
    if args.json:
        print(json.dumps(rows))
        return
    keys = list(PATTERNS) + ["shared_bytes", "loads_before_wait"]
    print("| kernel | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
