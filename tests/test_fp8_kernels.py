"""The fp8-weight skinny linear (kernels/triton_fp8.py) against dequantized weights in float64: block scales and
per-channel ones, with the SiLU-and-mul and residual fusions and the per-row activation quantization. On CPU in
Triton's interpreter (fp32, fp16); compiled on the GPU (bf16 too)."""
from __future__ import annotations

import pytest
import torch

triton_fp8 = pytest.importorskip("nanovllm.kernels.triton_fp8")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
FP8_MAX = 448.0


def quantize(w: torch.Tensor, block: tuple[int, int] | None):
    """(w_fp8, scales): per (bn x bk) block, or per row with block None; and the dequantized weight in float64."""
    n, k = w.shape
    bn, bk = block or (1, k)
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float64)
    padded[:n, :k] = w.double()
    amax = padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    full = scale.double().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    q = (w.double() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(DEVICE), scale.to(DEVICE), q.double() * full


def quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x per row and group of ``group`` columns through e4m3 and back, in float32 as the GEMM's quantization."""
    m, k = x.shape
    out = torch.empty(m, k, dtype=torch.float64)
    for g in range(0, k, group):
        part = x[:, g:g + group].float()
        amax = part.abs().amax(1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        out[:, g:g + group] = (part / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double() * scale
    return out


def check_linear(x: torch.Tensor, x_ref: torch.Tensor, n: int, block, fusion: str, act_quant: bool):
    """fp8_linear of x (``fusion``: none, silu_mul, residual or bias) against x_ref @ the dequantized weight in
    float64, within the output dtype's tolerance; returns (out, ref) in float64 on the CPU."""
    m, k = x.shape
    dtype = x.dtype
    w = torch.randn(2 * n if fusion == "silu_mul" else n, k) * 0.1
    w_fp8, scale, w_ref = quantize(w, block)
    bias = torch.randn(n) if fusion == "bias" else None
    residual = torch.randn(m, n).to(dtype) if fusion == "residual" else None
    ref = x_ref @ w_ref.T + (bias.double() if bias is not None else 0)
    if fusion == "silu_mul":
        ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
    if residual is not None:
        ref = ref + residual.double()
    out = triton_fp8.fp8_linear(x.to(DEVICE), w_fp8, scale, block,
                                None if bias is None else bias.to(dtype).to(DEVICE),
                                residual=None if residual is None else residual.to(DEVICE).clone(),
                                silu_mul=fusion == "silu_mul", act_quant=act_quant)
    assert out.shape == (m, n) and not out.isnan().any()
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    assert err < {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype], err
    return out.double().cpu(), ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [(128, 128), (32, 64), None])
@pytest.mark.parametrize("fusion", ["none", "silu_mul", "residual", "bias", "act_quant"])
def test_fp8_skinny_linear_matches_dequantized_weights(dtype, block, fusion):
    torch.manual_seed(0)
    m, k, n = 5, 320, 96  # K not a multiple of the block: the last block is partial
    x = torch.randn(m, k).to(dtype)
    act_quant = fusion == "act_quant"
    check_linear(x, quantize_groups(x, k) if act_quant else x.double(), n, block, "none" if act_quant else fusion,
                 act_quant)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [(128, 128), (32, 64), None])
@pytest.mark.parametrize("m,fusion", [(17, "none"), (70, "silu_mul"), (130, "residual"), (33, "bias")])
def test_fp8_gemm_matches_quantized_operands(dtype, block, m, fusion):
    """More than SKINNY_MAX_M rows: x quantized per token (per-channel weights) or per token and group of bk
    columns (block-wise), both operands multiplied in fp8; against the same quantization in float64."""
    torch.manual_seed(1)
    k, n = 320, 200  # partial K block, partial N tile, several M tiles at m = 130
    x = torch.randn(m, k).to(dtype)
    x[3] = 0.0  # a zero row's scale is 1, not 0/0
    out, ref = check_linear(x, quantize_groups(x, k if block is None else block[1]), n, block, fusion,
                            block is None)
    assert float((out[3] - ref[3]).abs().max()) < 1e-2
