"""The dense ops in Triton with ``reference.py``'s functions; ``linear``'s skinny kernel, for up to
SKINNY_MAX_M rows, reads the weight once and fuses SiLU-and-mul or the residual add (more rows go to
cuBLAS)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels import dot_precision

SKINNY_MAX_M = 16


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):
    """One row; rounds where the reference rounds."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    f = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(f * f, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs,
             (w.to(tl.float32) * (f * rstd).to(x.dtype).to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    m, n = x.shape
    out = torch.empty_like(x)
    if m:
        _rms_norm_kernel[(m,)](x, weight, out, x.stride(0), out.stride(0), n, eps,
                               BLOCK=triton.next_power_of_2(n))
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * n + offs, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
             mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    m, n = x.size(0), x.size(1) // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _silu_and_mul_kernel[(m, triton.cdiv(n, 1024))](x, out, x.stride(0), n, BLOCK=1024)
    return out


@triton.jit
def silu_mul_rounded(gate, up, x_ptr):
    """SiLU(gate) * up of fp32 accumulators, rounded to x's dtype where the unfused ops round."""
    dtype = x_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)


@triton.jit
def skinny_epilogue(acc, acc_up, x_ptr, b_ptr, res_ptr, y_ptr, rows, cols, row_mask, col_mask, n,
                    stride_r, stride_y, SILU_MUL: tl.constexpr, BIAS: tl.constexpr,
                    RESIDUAL: tl.constexpr):
    """Stores the skinny linear's tile: + bias, SiLU(gate) * up, + residual, in x's dtype."""
    if BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(b_ptr + n + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SILU_MUL:
        acc = silu_mul_rounded(acc, acc_up, x_ptr)
    if RESIDUAL:
        acc += tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=out_mask,
                       other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(x_ptr.dtype.element_ty),
             mask=out_mask)


@triton.jit(do_not_specialize=["m"])  # one compilation for every batch size (CUDA graph buckets)
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, res_ptr, y_ptr, m, k, n, stride_x, stride_w,
                          stride_r, stride_y, SILU_MUL: tl.constexpr, BIAS: tl.constexpr,
                          RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """BLOCK_N columns of y = x @ w.T (+ bias) for all m <= BLOCK_M rows. SILU_MUL: w is [gate; up]
    and y is SiLU(gate) * up; RESIDUAL: y += residual (y may be the residual: one program per
    element)."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # SILU_MUL's (unused otherwise)
    w_rows = cols.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = col_mask[:, None] & k_mask[None, :]
        acc = tl.dot(x, tl.trans(tl.load(w_ptr + w_rows + ks[None, :], mask=w_mask, other=0.0)),
                     acc, input_precision=PRECISION)
        if SILU_MUL:
            w_up = tl.load(w_ptr + n * stride_w + w_rows + ks[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PRECISION)
    skinny_epilogue(acc, acc_up, x_ptr, b_ptr, res_ptr, y_ptr, rows, cols, row_mask, col_mask, n,
                    stride_r, stride_y, SILU_MUL, BIAS, RESIDUAL)


def skinny_config(m: int, n: int, element_size: int, silu_mul: bool) -> dict:
    """All rows in one tile; columns 32 wide, or 16 where that leaves too few programs; as many K
    stages as fit."""
    block_m, block_k = max(16, triton.next_power_of_2(m)), 256 // element_size * 2
    block_n = 32 if n >= 32 * 120 else 16
    stage_bytes = (block_m + (2 if silu_mul else 1) * block_n) * block_k * element_size
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
                num_stages=max(2, min(4, 160 * 1024 // stage_bytes)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           residual: torch.Tensor | None = None, silu_mul: bool = False,
           config: dict | None = None):
    """``reference.linear``; ``config``: the skinny kernel's tiles."""
    m, k = x.shape
    if (m > SKINNY_MAX_M or x.stride(-1) != 1 or weight.stride(-1) != 1
            or (residual is not None and silu_mul)):
        if residual is not None and bias is None and not silu_mul:
            # the add in cuBLAS's epilogue (addmm would copy first)
            return residual.addmm_(x, weight.t())
        y = F.linear(x, weight, bias)
        y = silu_and_mul(y) if silu_mul else y
        return y if residual is None else residual.add_(y)
    n = weight.size(0) // (2 if silu_mul else 1)
    y = residual if residual is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        cfg = config or skinny_config(m, n, x.element_size(), silu_mul)
        _skinny_linear_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
            x, weight, bias if bias is not None else x, residual if residual is not None else x, y,
            m, k, n, x.stride(0), weight.stride(0),
            residual.stride(0) if residual is not None else 0, y.stride(0), SILU_MUL=silu_mul,
            BIAS=bias is not None, RESIDUAL=residual is not None, PRECISION=dot_precision(x.dtype),
            **cfg)
    return y
