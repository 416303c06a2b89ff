"""fp8 (e4m3) quantization in plain PyTorch: block-wise and per-row scales, and back; what the fp8
kernels, their references and the fp8 weight loaders share."""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest float8_e4m3fn


def quantize_fp8_block(w: torch.Tensor,
                       block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)]) with w ~= w_fp8 * scale_inv over each
    block; a block's scale is its amax / 448, so its largest value maps to e4m3's largest (an
    all-zero block gets scale 1)."""
    n, k = w.shape
    bn, bk = block
    padded = F.pad(w.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.size(0) // bn, bn, padded.size(1) // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:n, :k]
    return q.to(FP8).contiguous(), scale


def dequantize_fp8_block(w_fp8: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_fp8 [..., N, K] times each block's scale_inv [..., ceil(N/bn), ceil(K/bk)], in
    ``dtype``."""
    n, k = w_fp8.shape[-2:]
    scales = (scale_inv.float().repeat_interleave(block[0], -2)[..., :n, :]
              .repeat_interleave(block[1], -1)[..., :k])
    return (w_fp8.float() * scales).to(dtype)


def fake_quantize_activations(x: torch.Tensor, group: int,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] as W8A8 kernels multiply it: quantized to e4m3 per row and group of ``group``
    columns, then dequantized to ``dtype`` (the CPU references' emulation)."""
    return dequantize_fp8_block(*quantize_fp8_block(x, (1, group)), (1, group), dtype)


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8, scale [N, 1]): one scale per row (an output channel of a weight, a token of an
    activation)."""
    return quantize_fp8_block(w, (1, w.size(1)))
