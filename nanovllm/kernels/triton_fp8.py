"""fp8 (e4m3) weights in Triton: the skinny linear for up to SKINNY_MAX_M rows (decode batches), which reads each
weight byte once and dequantizes it in registers, with the block scales of an fp8 checkpoint ([N / bn, K / bk]) or
one scale per output channel ([N, 1]). ``act_quant`` also quantizes each row of x to e4m3 with its own scale first,
as online fp8 quantization's GEMM does. Rounding and fusions follow ``triton_linear``'s skinny kernel."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels import dot_precision
from nanovllm.kernels.triton_attention import FP8_MAX, _round_to_e4m3
from nanovllm.kernels.triton_linear import SKINNY_MAX_M, skinny_epilogue

# the interpreter's float -> e4m3 cast does not carry into the exponent: it rounds in fp32 arithmetic instead
_ROUND_FP8 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _row_scales(x_ptr, rows, row_mask, k, stride_x, BLOCK_K: tl.constexpr):
    """Each row's e4m3 scale: its amax / 448 (1 for a zero row)."""
    amax = tl.zeros([rows.shape[0]], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & (ks < k)[None, :],
                    other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
    return tl.where(amax > 0, amax / FP8_MAX, 1.0)


@triton.jit
def _dequantized(w_ptr, s_ptr, w_rows, cols, ks, mask, k0, stride_s, dtype: tl.constexpr, SCALE_N: tl.constexpr,
                 SCALE_K: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] tile of w times its scales, in ``dtype`` (the chunk lies in one block of K)."""
    w = tl.load(w_ptr + w_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    if PER_CHANNEL:
        scale = tl.load(s_ptr + cols * stride_s)
    else:
        scale = tl.load(s_ptr + (cols // SCALE_N) * stride_s + k0 // SCALE_K)
    return (w * scale[:, None]).to(dtype)


@triton.jit(do_not_specialize=["m"])
def _fp8_skinny_kernel(x_ptr, w_ptr, s_ptr, b_ptr, res_ptr, y_ptr, m, k, n, stride_x, stride_w, stride_s, stride_r,
                       stride_y, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
                       ACT_QUANT: tl.constexpr, SILU_MUL: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr, ROUND_FP8: tl.constexpr):
    """BLOCK_N columns of y = x @ dequantize(w).T (+ bias) for all m <= BLOCK_M rows; SILU_MUL: w is [gate; up]
    (scale rows too) and y is SiLU(gate) * up; RESIDUAL: y += residual."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    dtype = x_ptr.dtype.element_ty
    if ACT_QUANT:
        x_scale = _row_scales(x_ptr, rows, row_mask, k, stride_x, BLOCK_K)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    safe_cols = tl.where(col_mask, cols, 0)
    w_rows = safe_cols.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if ACT_QUANT:
            q = tl.minimum(tl.maximum(x.to(tl.float32) / x_scale, -FP8_MAX), FP8_MAX)
            q = _round_to_e4m3(q) if ROUND_FP8 else q.to(tl.float8e4nv).to(tl.float32)
            x = (q * x_scale).to(dtype)
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = _dequantized(w_ptr, s_ptr, w_rows, safe_cols, ks, w_mask, k0, stride_s, dtype, SCALE_N, SCALE_K,
                         PER_CHANNEL)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if SILU_MUL:
            w_up = _dequantized(w_ptr + n * stride_w, s_ptr, w_rows, n + safe_cols, ks, w_mask, k0, stride_s, dtype,
                                SCALE_N, SCALE_K, PER_CHANNEL)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PRECISION)
    skinny_epilogue(acc, acc_up, x_ptr, b_ptr, res_ptr, y_ptr, rows, cols, row_mask, col_mask, n, stride_r, stride_y,
                    SILU_MUL, BIAS, RESIDUAL)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None, *, residual: torch.Tensor | None = None, silu_mul: bool = False,
               act_quant: bool = False) -> torch.Tensor:
    """x [m <= SKINNY_MAX_M, K] @ the fp8 weight [N, K] dequantized: by its block scales
    [ceil(N / bn), ceil(K / bk)] (``block`` = (bn, bk)) or, with ``block`` None, by one scale per row [N, 1].
    Returns residual += y when ``residual`` is given (in place)."""
    m, k = x.shape
    assert m <= SKINNY_MAX_M and x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.dtype == torch.float8_e4m3fn
    n = weight.size(0) // (2 if silu_mul else 1)
    scale_n, scale_k = block if block is not None else (1, k)
    block_k = min(128, triton.next_power_of_2(scale_k)) if block is None else scale_k
    assert block is None or (block_k & (block_k - 1) == 0 and block_k >= 16), "bk: a power of two >= 16"
    y = residual if residual is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_n = 32 if n >= 32 * 120 else 16
        _fp8_skinny_kernel[(triton.cdiv(n, block_n),)](
            x, weight, scale, bias if bias is not None else x, residual if residual is not None else x, y, m, k, n,
            x.stride(0), weight.stride(0), scale.stride(0), residual.stride(0) if residual is not None else 0,
            y.stride(0), SCALE_N=scale_n, SCALE_K=scale_k if block is not None else 1, PER_CHANNEL=block is None,
            ACT_QUANT=act_quant, SILU_MUL=silu_mul, BIAS=bias is not None, RESIDUAL=residual is not None,
            BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
            PRECISION=dot_precision(x.dtype), ROUND_FP8=_ROUND_FP8, num_warps=4, num_stages=3)
    return y
