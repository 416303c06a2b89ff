"""The decoder's dense layers in Triton: RMSNorm (with the residual add), SiLU-and-mul, and a linear
layer for the few rows of a decode step that fuses its neighbours into one launch.

Same functions as ``reference.py`` (the oracle), rounding where it rounds: the residual sum and the
normalized input are rounded to the dtype before they are used, the gate and up projections before
SiLU-and-mul. At decode batch sizes a linear layer reads its whole weight for a few rows, so its time
is the weight's bytes over the memory bandwidth plus a launch; ``linear`` with at most ``SKINNY_MAX_M``
rows is one kernel that reads the weight once in tiles of output columns (each program all rows, all of
K), and takes the RMSNorm before it (``norm_weight``; with ``residual``, the add before that) and the
SiLU-and-mul after it (``silu_mul``) into the same launch. More rows go to cuBLAS, with the norm and
activation kernels around it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels import reference

SKINNY_MAX_M = 16


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 stays exact (not tf32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, n, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * n + offs, x, mask=mask)
    f = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(f * f, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * (f * rstd).to(x.dtype).to(tl.float32)).to(x.dtype),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of x [M, H] (with ``residual``: of x + residual). Returns (normed, the new
    residual: x + residual, or x itself without one)."""
    m, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if m:
        _rms_norm_kernel[(m,)](x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
                               residual.stride(0) if residual is not None else 0, out.stride(0), n, eps,
                               ADD=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out, res_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * n + offs, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for x [M, 2 * I] = [gate | up] -> [M, I]."""
    m, n = x.size(0), x.size(1) // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _silu_and_mul_kernel[(m, triton.cdiv(n, 1024))](x, out, x.stride(0), n, BLOCK=1024)
    return out


@triton.jit
def _load_input(x_ptr, res_ptr, rows, ks, row_mask, k_mask, stride_x, stride_r, ADD: tl.constexpr):
    mask = row_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
    if ADD:
        r = tl.load(res_ptr + rows[:, None] * stride_r + ks[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit(do_not_specialize=["m"])  # one compilation for every batch size (CUDA graph buckets)
def _skinny_linear_kernel(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, b_ptr, y_ptr, m, k, n, stride_x,
                          stride_r, stride_w, stride_y, eps, ADD: tl.constexpr, NORM: tl.constexpr,
                          ONE_PASS: tl.constexpr, SILU_MUL: tl.constexpr, BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PRECISION: tl.constexpr):
    """Output columns [pid * BLOCK_N, +BLOCK_N) of y = f(x) @ w.T for rows [pid_m * BLOCK_M, +BLOCK_M);
    f: (x + residual), then RMSNorm. With SILU_MUL, w is [gate; up] (2n rows) and y = SiLU(gate) * up.
    The norm's 1 / rms is a per-row factor: ONE_PASS multiplies it into the accumulator at the end, so the
    weight's loads start at once (x * norm weight is rounded to the dtype instead of x * 1/rms, then that);
    otherwise (fp16, whose range x * norm weight could leave) a first pass over the rows finds it."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    dtype = x_ptr.dtype.element_ty
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM and not ONE_PASS:
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            f = _load_input(x_ptr, res_ptr, rows, ks, row_mask, ks < k, stride_x, stride_r, ADD).to(tl.float32)
            sumsq += tl.sum(f * f, 1)
        rstd = tl.rsqrt(sumsq / k + eps)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = cols.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + w_rows + ks[None, :], mask=w_mask, other=0.0)
        if SILU_MUL:
            w_up = tl.load(w_ptr + n * stride_w + w_rows + ks[None, :], mask=w_mask, other=0.0)
        x = _load_input(x_ptr, res_ptr, rows, ks, row_mask, k_mask, stride_x, stride_r, ADD)
        if ADD and pid_n == 0:  # the new residual, written once
            tl.store(res_out_ptr + rows[:, None] * k + ks[None, :], x, mask=row_mask[:, None] & k_mask[None, :])
        if NORM:
            f = x.to(tl.float32)
            g = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            if ONE_PASS:
                sumsq += tl.sum(f * f, 1)
                x = (g * f).to(dtype)
            else:
                x = (g * (f * rstd).to(dtype).to(tl.float32)).to(dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if SILU_MUL:
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PRECISION)
    if NORM and ONE_PASS:
        rstd = tl.rsqrt(sumsq / k + eps)[:, None]
        acc *= rstd
        if SILU_MUL:
            acc_up *= rstd
    if BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(b_ptr + n + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:  # rounded where the unfused path rounds: the projections, then SiLU(gate)
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(dtype),
             mask=row_mask[:, None] & col_mask[None, :])


def skinny_config(m: int, element_size: int, silu_mul: bool) -> dict:
    """Tile sizes for the skinny kernel: all rows in one tile; columns in tiles of 32 (each program
    re-reads x, m x K, so x's traffic is m / BLOCK_N of the weight's); as many pipeline stages of
    K as fit in shared memory."""
    block_m, block_n, block_k = max(16, triton.next_power_of_2(m)), 32, 256 // element_size * 2
    stage_bytes = (block_m + (2 if silu_mul else 1) * block_n) * block_k * element_size
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
                num_stages=max(2, min(4, 160 * 1024 // stage_bytes)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
           silu_mul: bool = False, config: dict | None = None):
    """y = f(x) @ weight.T + bias, f the RMSNorm of ``norm_weight`` (of x + residual with ``residual``) or
    the identity; with ``silu_mul`` weight is [gate; up] and y = SiLU(gate) * up. Returns y, or (y, the new
    residual) when ``norm_weight`` is given (x itself without ``residual``). ``config``: tile sizes of the
    skinny kernel (by default ``skinny_config``'s)."""
    m, k = x.shape
    if m > SKINNY_MAX_M or x.stride(-1) != 1 or weight.stride(-1) != 1:
        return reference.unfused_linear(rms_norm, silu_and_mul, x, weight, bias, norm_weight, eps, residual, silu_mul)
    n = weight.size(0) // (2 if silu_mul else 1)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    add = residual is not None
    new_residual = torch.empty_like(x) if add else x
    if m:
        cfg = config or skinny_config(m, x.element_size(), silu_mul)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
        _skinny_linear_kernel[grid](
            x, residual if add else x, new_residual, norm_weight if norm_weight is not None else x, weight,
            bias if bias is not None else x, y, m, k, n, x.stride(0), residual.stride(0) if add else 0,
            weight.stride(0), y.stride(0), eps, ADD=add, NORM=norm_weight is not None,
            ONE_PASS=x.dtype != torch.float16, SILU_MUL=silu_mul,
            BIAS=bias is not None, PRECISION=_precision(x.dtype), **cfg)
    return y if norm_weight is None else (y, new_residual)
