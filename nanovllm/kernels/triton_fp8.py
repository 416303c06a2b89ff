"""fp8 (e4m3) weights in Triton, with the block scales of an fp8 checkpoint ([N / bn, K / bk]) or
one scale per output channel ([N, 1]). Activations are quantized to e4m3 too (W8A8, as vLLM does),
at every batch size: per token for per-channel weights, per token and group of bk columns for
block-wise ones.
- the skinny linear, for up to SKINNY_MAX_M rows (decode batches): it reads each weight byte once;
  x comes quantized by ``quantize_activations`` (measured faster than quantizing it in each
  program's loop, whose reductions serialize every chunk); ``tl.dot`` on e4m3 operands (on sm_90
  at 16 rows: each converted exactly to fp16 in registers, then mma.sync; in the interpreter and
  for fp32, converted to x's dtype), the scales on each chunk's product; K split over several
  programs where the column tiles are too few to fill the GPU. Fusions follow ``triton_linear``'s;
- the GEMM, for more rows (prefill, large decode batches): x quantized by a kernel of its own, both
  operands multiplied on the sm_90 fp8 tensor cores, the scales applied to the fp32 accumulator."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels import dot_precision
from nanovllm.kernels.triton_attention import FP8_MAX, _round_to_e4m3, device_properties, num_sms
from nanovllm.kernels.triton_linear import SKINNY_MAX_M, silu_and_mul, skinny_epilogue

# the interpreter's float -> e4m3 cast does not carry into the exponent: it rounds in fp32
# arithmetic instead
_ROUND_FP8 = os.environ.get("TRITON_INTERPRET") == "1"
# tl.dot straight on e4m3 operands in the skinny kernel (sm_89+ MMA) instead of converting both to
# x's dtype first
FP8_DOT = os.environ.get("NANOVLLM_FP8_DOT", "1") == "1"


@triton.jit
def _chunk_product(x, w_ptr, s_ptr, w_rows, cols, col_mask, ks, kj, k, stride_s, scale,
                   dtype: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                   PER_CHANNEL: tl.constexpr, FP8_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """x (e4m3, one chunk of K) @ w[:, ks].T times ``scale`` (x's per-row scales as a column) and,
    block-wise, the weight block's scales (per-channel ones are applied once, at the end); on the
    fp8 MMA or in ``dtype``."""
    w = tl.load(w_ptr + w_rows + ks[None, :], mask=col_mask[:, None] & (ks < k)[None, :], other=0.0)
    if FP8_DOT:
        part = tl.dot(x, tl.trans(w))
    else:  # e4m3 -> dtype is exact
        part = tl.dot(x.to(dtype), tl.trans(w.to(dtype)), input_precision=PRECISION)
    if not PER_CHANNEL:
        # a chunk past K (BLOCK_K's last step) has no scales: read none (0 * NaN garbage is NaN)
        scale = scale * tl.load(s_ptr + (cols // SCALE_N) * stride_s + kj // SCALE_K,
                                mask=col_mask & (kj < k), other=0.0)[None, :]
    return part * scale


@triton.jit(do_not_specialize=["m"])
def _fp8_skinny_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, res_ptr, y_ptr, ws_ptr, count_ptr, m,
                       k, n, split_k, stride_x, stride_xs, stride_w, stride_s, stride_r, stride_y,
                       SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
                       SILU_MUL: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       CHUNK_K: tl.constexpr, SPLIT: tl.constexpr, FP8_DOT: tl.constexpr,
                       PRECISION: tl.constexpr):
    """BLOCK_N columns of y = x @ dequantize(w).T (+ bias) for all m <= BLOCK_M rows, x in e4m3
    with its scales ``xs`` [m, groups] (``quantize_activations``'s: per row, PER_CHANNEL, or per row
    and chunk of CHUNK_K, the weight's block in K), BLOCK_K columns of K a step in chunks of
    CHUNK_K.
    SILU_MUL: w is [gate; up] (scale rows too) and y is SiLU(gate) * up; RESIDUAL: y += residual.
    SPLIT: program (i, j) sums the j-th of ``split_k`` slices of K into the fp32 workspace ``ws``
    [BLOCK_M, 2n] (zero between calls); the last of a column tile's programs to finish (``count``
    [tiles], zero between calls) takes the sums, leaves zeros behind and stores the tile."""
    pid, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    safe_cols = tl.where(col_mask, cols, 0)
    w_rows = safe_cols.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + rows[:, None] * stride_x
    x_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if PER_CHANNEL:
        x_scale = tl.load(xs_ptr + rows * stride_xs, mask=row_mask, other=1.0)
    per_split = tl.cdiv(tl.cdiv(k, BLOCK_K), split_k) * BLOCK_K
    for k0 in range(split * per_split, tl.minimum(k, (split + 1) * per_split), BLOCK_K):
        for j in tl.static_range(BLOCK_K // CHUNK_K):
            kj = k0 + j * CHUNK_K
            ks = kj + tl.arange(0, CHUNK_K)
            xq = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & (ks < k)[None, :],
                         other=0.0)
            if not PER_CHANNEL:  # a chunk past K (BLOCK_K's last step) has none
                x_scale = tl.load(xs_ptr + rows * stride_xs + kj // CHUNK_K,
                                  mask=row_mask & (kj < k), other=1.0)
            acc += _chunk_product(xq, w_ptr, s_ptr, w_rows, safe_cols, col_mask, ks, kj, k,
                                  stride_s, x_scale[:, None], dtype, SCALE_N, SCALE_K, PER_CHANNEL,
                                  FP8_DOT, PRECISION)
            if SILU_MUL:
                acc_up += _chunk_product(xq, w_ptr + n * stride_w, s_ptr, w_rows, n + safe_cols,
                                         col_mask, ks, kj, k, stride_s, x_scale[:, None], dtype,
                                         SCALE_N, SCALE_K, PER_CHANNEL, FP8_DOT, PRECISION)
    if SPLIT:
        sums = ws_ptr + rows[:, None] * (2 * n) + cols[None, :]
        out_mask = row_mask[:, None] & col_mask[None, :]
        tl.atomic_add(sums, acc, mask=out_mask, sem="release")
        if SILU_MUL:
            tl.atomic_add(sums + n, acc_up, mask=out_mask, sem="release")
        tl.debug_barrier()  # every thread's sums are in before the count says so
        last = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel") == split_k - 1
        if last:  # the sums, zeros left behind (as int32 bits: the interpreter swaps no floats)
            bits = sums.to(tl.pointer_type(tl.int32))
            zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
            acc = tl.atomic_xchg(bits, zeros, mask=out_mask, sem="acquire").to(tl.float32,
                                                                                bitcast=True)
            if SILU_MUL:
                acc_up = tl.atomic_xchg(bits + n, zeros, mask=out_mask, sem="acquire").to(
                    tl.float32, bitcast=True)
            tl.store(count_ptr + pid, 0)
    else:
        last = True
    if last:
        if PER_CHANNEL:
            acc *= tl.load(s_ptr + safe_cols * stride_s)[None, :]
            if SILU_MUL:
                acc_up *= tl.load(s_ptr + (n + safe_cols) * stride_s)[None, :]
        skinny_epilogue(acc, acc_up, y_ptr, b_ptr, res_ptr, y_ptr, rows, cols, row_mask, col_mask,
                        n, stride_r, stride_y, SILU_MUL, BIAS, RESIDUAL)


def skinny_config(n: int, k: int, num_sms: int = 132) -> dict:
    """Where 64-column tiles are at least the SMs (gate_up_proj of Qwen3-8B): 32 columns, 256
    bytes of each weight row a step, four stages. Else (qkv_proj, o_proj, down_proj: one wave of
    long programs otherwise) 64 columns, 128 bytes a step, K split in 4 (6 from K = 8192 on).
    ``tools/bench_fp8.py --skinny-sweep`` (H200, 2026-12-04, two calls): the best W8A8 rule of its
    70 tiles and splits on the 8B's projections at 1 and 16 rows, within 3% of the best per layer
    at one row (o_proj at 16 rows: 6%)."""
    if triton.cdiv(n, 64) >= num_sms:
        return dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=4)
    split = 1 if k < 1024 else 6 if k >= 8192 else 4
    return dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, num_warps=4, num_stages=4)


_WORKSPACE_COLUMNS = 65536  # 2n of the widest layer split over K (fp32, 16 rows: 4 MiB)
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def split_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K sums [SKINNY_MAX_M, 2n] and column-tile counts of ``device``, zeros, made once
    (a CUDA graph keeps their addresses); the kernel leaves them zero."""
    if device not in _workspaces:
        _workspaces[device] = (
            torch.zeros(SKINNY_MAX_M * _WORKSPACE_COLUMNS, dtype=torch.float32, device=device),
            torch.zeros(_WORKSPACE_COLUMNS, dtype=torch.int32, device=device))
    return _workspaces[device]


def fp8_skinny(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None, bias: torch.Tensor | None,
               residual: torch.Tensor | None, silu_mul: bool, config: dict | None = None,
               fp8_dot: bool | None = None):
    """``fp8_linear`` for m <= SKINNY_MAX_M rows, x quantized by ``quantize_activations`` first;
    ``config``: ``skinny_config``'s keys; ``fp8_dot``: ``tl.dot`` on the e4m3 operands (default:
    FP8_DOT, off in the interpreter and for fp32)."""
    m, k = x.shape
    n = weight.size(0) // (2 if silu_mul else 1)
    y = residual if residual is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        cfg = dict(config or skinny_config(n, k, num_sms(x.device) if x.is_cuda else 132))
        chunk = 128 if block is None else block[1]
        if fp8_dot is None:
            fp8_dot = FP8_DOT and not _ROUND_FP8 and x.dtype != torch.float32
        tiles = triton.cdiv(n, cfg["BLOCK_N"])
        split_k = cfg.pop("SPLIT_K", 1) if 2 * n <= _WORKSPACE_COLUMNS else 1
        ws, count = split_workspace(x.device) if split_k > 1 else (y, y)
        xq, xs = quantize_activations(x, chunk if block else k)
        _fp8_skinny_kernel[(tiles, split_k)](
            xq, xs, weight, scale, bias if bias is not None else x,
            residual if residual is not None else x, y, ws, count, m, k, n, split_k, xq.stride(0),
            xs.stride(0), weight.stride(0), scale.stride(0),
            residual.stride(0) if residual is not None else 0, y.stride(0),
            SCALE_N=block[0] if block is not None else 1,
            SCALE_K=block[1] if block is not None else 1, PER_CHANNEL=block is None,
            SILU_MUL=silu_mul, BIAS=bias is not None, RESIDUAL=residual is not None,
            BLOCK_M=max(16, triton.next_power_of_2(m)), CHUNK_K=chunk, SPLIT=split_k > 1,
            FP8_DOT=fp8_dot, PRECISION=dot_precision(x.dtype),
            **(cfg | dict(BLOCK_K=max(cfg["BLOCK_K"], chunk))))
    return y


# ---- the tensor-core GEMM: x quantized to e4m3 (per token, or per token and group of bk columns),
# then fp8 x fp8
@triton.jit(do_not_specialize=["m"])
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, m, k, stride_x, stride_q, stride_s, GROUP,
                            BLOCK: tl.constexpr, ROUND_FP8: tl.constexpr):
    """Row ``program_id(0)``'s columns [g * GROUP, (g + 1) * GROUP) to e4m3, g = ``program_id(1)``,
    with their scale (amax / 448, 1 for zeros) in s[row, g]."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * GROUP
    end = tl.minimum(start + GROUP, k)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(start, end, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < end, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    amax_all = tl.max(amax, 0)
    scale = tl.where(amax_all > 0, amax_all / FP8_MAX, 1.0)
    for k0 in range(start, end, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < end, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        if ROUND_FP8:
            q = _round_to_e4m3(q)
        tl.store(q_ptr + row * stride_q + ks, q.to(tl.float8e4nv), mask=ks < end)
    tl.store(s_ptr + row * stride_s + g, scale)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3 [m, k], scales [m, ceil(k / group)] in float32): x ~= q * scale over each row's
    group."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_groups_kernel[(m, groups)](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
                                             group, BLOCK=min(1024, triton.next_power_of_2(group)),
                                             ROUND_FP8=_ROUND_FP8)
    return q, s


@triton.jit(do_not_specialize=["m"])
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, res_ptr, y_ptr, m, n, k, stride_a,
                     stride_as, stride_w, stride_ws, stride_r, stride_y, SCALE_N: tl.constexpr,
                     SCALE_K: tl.constexpr, PER_CHANNEL: tl.constexpr, BIAS: tl.constexpr,
                     RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] tile of y = (a * a_scale) @ (w * w_scale).T (+ bias, + residual), a and
    w in e4m3 and multiplied on the tensor cores in fp8. PER_CHANNEL: one scale per row of a and of
    w, applied once at the end; else a's scale per (row, group of SCALE_K) and w's per (SCALE_N x
    SCALE_K) block, applied per K block."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
    # GROUP_M row tiles sweep the columns together: w stays in L2
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    safe_rows, safe_cols = tl.where(row_mask, rows, 0), tl.where(col_mask, cols, 0)
    a_rows = a_ptr + safe_rows.to(tl.int64)[:, None] * stride_a
    w_rows = w_ptr + safe_cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + ks[None, :], mask=(ks < k)[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=(ks < k)[None, :], other=0.0)
        if PER_CHANNEL:
            acc = tl.dot(a, tl.trans(w), acc)
        else:
            a_scale = tl.load(as_ptr + safe_rows * stride_as + k0 // SCALE_K)
            w_scale = tl.load(ws_ptr + (safe_cols // SCALE_N) * stride_ws + k0 // SCALE_K)
            acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale[None, :]
    if PER_CHANNEL:
        acc *= (tl.load(as_ptr + safe_rows * stride_as)[:, None]
                * tl.load(ws_ptr + safe_cols * stride_ws)[None, :])
    skinny_epilogue(acc, acc, y_ptr, b_ptr, res_ptr, y_ptr, rows, cols, row_mask, col_mask, n,
                    stride_r, stride_y, False, BIAS, RESIDUAL)


def gemm_config(m: int, n: int) -> dict:
    """64 rows a tile (one warpgroup's wgmma); 128 columns while that gives every SM a tile, else
    64; K 128 a step (one block of the scales); four stages (``tools/bench_fp8.py --sweep``'s choice
    at 64-8192 rows)."""
    block_n = 128 if triton.cdiv(m, 64) * triton.cdiv(n, 128) >= 132 else 64
    return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             block: tuple[int, int] | None, bias: torch.Tensor | None,
             residual: torch.Tensor | None, config: dict | None = None) -> torch.Tensor:
    """``fp8_linear`` on the tensor cores: x quantized per token (``block`` None) or per token and
    group of bk."""
    m, k = x.shape
    n = weight.size(0)
    scale_n, scale_k = block if block is not None else (1, k)
    cfg = dict(config or gemm_config(m, n))
    if block is not None:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], scale_k)  # a K step within one block of the scales
    a, a_scale = quantize_activations(x, scale_k)
    y = residual if residual is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fp8_gemm_kernel[grid](a, a_scale, weight, scale, bias if bias is not None else y,
                           residual if residual is not None else y, y, m, n, k, a.stride(0),
                           a_scale.stride(0), weight.stride(0), scale.stride(0),
                           residual.stride(0) if residual is not None else 0, y.stride(0),
                           SCALE_N=scale_n, SCALE_K=scale_k if block is not None else 1,
                           PER_CHANNEL=block is None, BIAS=bias is not None,
                           RESIDUAL=residual is not None, **cfg)
    return y


# cuBLAS's fp8 GEMM (torch._scaled_mm) where it measured faster than fp8_gemm on the H200
# (``tools/bench_fp8.py``, Qwen3-8B's projections, 2026-12-04): block-wise scales from 17 rows on
# (1x128 activations, 128x128 weights, K a multiple of 512; e.g. 4,096 rows of gate_up_proj: 852
# against 1,344 us), per-channel ones (row-wise) from SCALED_MM_CHANNEL_M rows on (at 64 rows and
# fewer ours is as fast or faster) and where K is at least SCALED_MM_CHANNEL_K (the 8B's, where it
# was measured; Qwen3-0.6B's smaller layers were not, and bench.py there ran 0.90x bf16 with them
# on cuBLAS too).
SCALED_MM_CHANNEL_M, SCALED_MM_CHANNEL_K = 65, 4096


def uses_scaled_mm(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether ``fp8_linear`` runs x's rows through ``scaled_mm``: on sm_90 (cuBLAS's block-wise
    scaling is Hopper's), a bf16 x (the output dtype measured; PyTorch's row-wise path has taken no
    other), sizes cuBLAS takes (multiples of 16; block-wise: 128x128 blocks, K a multiple of
    4 x 128: see ``scaled_mm``), and rows past SKINNY_MAX_M (block-wise) or from
    SCALED_MM_CHANNEL_M on with K from SCALED_MM_CHANNEL_K on (per-channel)."""
    n, k = weight.shape
    if block is None:
        shapes = (x.size(0) >= SCALED_MM_CHANNEL_M and k >= SCALED_MM_CHANNEL_K and n % 16 == 0
                  and k % 16 == 0)
    else:
        shapes = x.size(0) > SKINNY_MAX_M and block == (128, 128) and n % 16 == 0 and k % 512 == 0
    if not (shapes and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    properties = device_properties(x.device)
    return (properties.major, properties.minor) == (9, 0)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              block: tuple[int, int] | None) -> torch.Tensor:
    """x @ dequantize(weight).T through ``torch._scaled_mm``, x quantized as ``fp8_gemm`` does (per
    token, or per token and 128 columns). Block-wise, cuBLAS reads both scales with their long side
    contiguous (x's [M, K / 128] M-major, the weight's [N / 128, K / 128] K-major) and that side a
    multiple of 4: it refuses 17 rows, and it read 2 or 5 blocks of K wrong, without a word (the
    H200, 2026-12-04). So x gets zero rows up to a multiple of 4, and ``uses_scaled_mm`` takes
    only weights whose blocks of K are a multiple of 4 (Qwen3's are)."""
    m = x.size(0)
    if block is None:
        a, a_scale = quantize_activations(x, x.size(1))
        return torch._scaled_mm(a, weight.t(), scale_a=a_scale, scale_b=scale.view(1, -1),
                                out_dtype=x.dtype)
    a, a_scale = quantize_activations(torch.nn.functional.pad(x, (0, 0, 0, -m % 4)) if m % 4
                                      else x, 128)
    return torch._scaled_mm(a, weight.t(), scale_a=a_scale.t().contiguous().t(),
                            scale_b=scale.t(), out_dtype=x.dtype)[:m]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None, bias: torch.Tensor | None = None, *,
               residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """quantize(x) [m, K] @ the fp8 weight [N, K] dequantized: by its block scales [ceil(N / bn),
    ceil(K / bk)] (``block`` = (bn, bk)) or, with ``block`` None, by one scale per row [N, 1]. x is
    quantized to e4m3 per token (per-channel weights) or per token and group of bk columns
    (block-wise), at every batch size, as vLLM does. Returns residual += y when ``residual`` is
    given (in place). Up to SKINNY_MAX_M rows the skinny kernel, more the tensor-core GEMM (ours
    or, where ``uses_scaled_mm``, cuBLAS's)."""
    m, k = x.shape
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.dtype == torch.float8_e4m3fn
    assert block is None or (block[1] & (block[1] - 1) == 0 and 16 <= block[1] <= 512), \
        "bk: a power of two, 16-512"
    if m <= SKINNY_MAX_M:
        return fp8_skinny(x, weight, scale, block, bias, residual, silu_mul)
    if uses_scaled_mm(x, weight, block):
        y = scaled_mm(x, weight, scale, block)
        if bias is not None:
            y += bias
    elif not silu_mul:
        return fp8_gemm(x, weight, scale, block, bias, residual)
    else:
        y = fp8_gemm(x, weight, scale, block, bias, None)
    if silu_mul:
        y = silu_and_mul(y)
    return y if residual is None else residual.add_(y)
