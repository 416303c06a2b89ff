"""The fp8-weight linear kernels (kernels/triton_fp8.py) against the same quantization in float64:
block scales and per-channel ones, activations quantized per row or per row and group, with the
SiLU-and-mul, bias and residual fusions. On CPU in Triton's interpreter (fp32, fp16); compiled on
the GPU (bf16 too)."""
from __future__ import annotations

import pytest
import torch

triton_fp8 = pytest.importorskip("nanovllm.kernels.triton_fp8")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
FP8_MAX = 448.0
# relative error, by output dtype
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# Hopper's fp8 tensor cores keep about 14 bits of mantissa while they add up products (DeepSeek-V3
# report, 3.3.2), so an fp8 x fp8 product's error is about 1e-4 relative whatever the output dtype
# (measured: 6e-5 to 4e-4 in fp32)
FP8_MMA_TOLERANCE = 1e-3


def quantize(w: torch.Tensor, block: tuple[int, int] | None):
    """(w_fp8, scales): per (bn x bk) block, or per row with block None; and the dequantized weight
    in float64."""
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
    """x per row and group of ``group`` columns through e4m3 and back, in float32 as the GEMM's
    quantization."""
    m, k = x.shape
    out = torch.empty(m, k, dtype=torch.float64)
    for g in range(0, k, group):
        part = x[:, g:g + group].float()
        amax = part.abs().amax(1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        out[:, g:g + group] = ((part / scale).clamp(-FP8_MAX, FP8_MAX)
                               .to(torch.float8_e4m3fn).double() * scale)
    return out


def check_linear(x: torch.Tensor, n: int, block, fusion: str, tol: float | None = None,
                 spread: bool = False, **kwargs):
    """fp8_linear of x (``fusion``: none, silu_mul, residual or bias) against x quantized as the
    kernels quantize it (per row, or per row and group of bk columns) @ the dequantized weight in
    float64, within the output dtype's tolerance (or ``tol``); returns (out, ref) in float64 on the
    CPU. ``spread``: the weight's 128x128 blocks scaled apart by up to 2**8 (a scale read from the
    wrong block shows). ``kwargs`` go to fp8_skinny instead."""
    m, k = x.shape
    dtype = x.dtype
    w = torch.randn(2 * n if fusion == "silu_mul" else n, k) * 0.1
    if spread:
        blocks = torch.exp2(torch.randint(-4, 5, (w.size(0) // 128, k // 128)).float())
        w *= blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)
    w_fp8, scale, w_ref = quantize(w, block)
    bias = torch.randn(n) if fusion == "bias" else None
    residual = torch.randn(m, n).to(dtype) if fusion == "residual" else None
    ref = (quantize_groups(x, k if block is None else block[1]) @ w_ref.T
           + (bias.double() if bias is not None else 0))
    if fusion == "silu_mul":
        ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
    if residual is not None:
        ref = ref + residual.double()
    args = (x.to(DEVICE), w_fp8, scale, block, None if bias is None else bias.to(dtype).to(DEVICE))
    residual = None if residual is None else residual.to(DEVICE).clone()
    out = (triton_fp8.fp8_skinny(*args, residual, fusion == "silu_mul", **kwargs) if kwargs else
           triton_fp8.fp8_linear(*args, residual=residual, silu_mul=fusion == "silu_mul"))
    assert out.shape == (m, n) and not out.isnan().any()
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    assert err < (tol or TOLERANCE[dtype]), err
    return out.double().cpu(), ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [(128, 128), (32, 64), None])
@pytest.mark.parametrize("fusion", ["none", "silu_mul", "residual", "bias"])
def test_fp8_skinny_linear_matches_quantized_operands(dtype, block, fusion):
    torch.manual_seed(0)
    m, k, n = 5, 320, 96  # K not a multiple of the block: the last block is partial
    x = torch.randn(m, k).to(dtype)
    x[2] = 0.0  # a zero row's scale is 1, not 0/0
    # one group of a row far larger than the rest: per-group scales differ from per-row ones
    x[1, :64] *= 50.0
    check_linear(x, n, block, fusion)


@pytest.mark.parametrize("block", [(128, 128), None])
@pytest.mark.parametrize("fusion", ["silu_mul", "residual", "bias"])
def test_fp8_skinny_split_over_k_matches_and_leaves_its_workspace_zero(block, fusion):
    """SPLIT_K programs per column tile add their slices of K into the workspace; the last one
    stores the tile (the fusions once, on the whole sum) and leaves zeros for the next call. Uneven
    splits too: 6 slices of 3 steps over 13 steps of K, the last one empty."""
    torch.manual_seed(3)
    dtype = torch.bfloat16 if CUDA else torch.float32
    for m, split, tiles in [(3, 6, dict(BLOCK_N=16, BLOCK_K=128)),
                            (16, 2, dict(BLOCK_N=32, BLOCK_K=256))]:
        x = torch.randn(m, 1600).to(dtype)
        x[0, :128] *= 30.0
        config = dict(tiles, SPLIT_K=split, num_warps=4, num_stages=2)
        for _ in range(2):  # the second call finds the workspace as the first left it
            check_linear(x, 80, block, fusion, tol=max(TOLERANCE[dtype], FP8_MMA_TOLERANCE),
                         config=config)
        assert triton_fp8.skinny_config(80, 1600)["SPLIT_K"] == 4  # the default splits it too
        check_linear(x, 80, block, fusion, tol=max(TOLERANCE[dtype], FP8_MMA_TOLERANCE))
        sums, counts = triton_fp8.split_workspace(torch.device(DEVICE))
        assert not sums.any() and not counts.any()

@pytest.mark.skipif(not CUDA, reason="the fp8 MMA needs an sm_89+ GPU; the interpreter converts "
                                     "both operands")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [(128, 128), None])
def test_fp8_skinny_on_the_fp8_mma_and_in_the_activation_dtype_agree(dtype, block):
    torch.manual_seed(2)
    x = torch.randn(9, 1024).to(dtype)
    for fp8_dot in (True, False):
        check_linear(x, 256, block, "silu_mul", fp8_dot=fp8_dot)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [(128, 128), (32, 64), None])
@pytest.mark.parametrize("m,fusion", [(17, "none"), (70, "silu_mul"), (130, "residual"),
                                      (33, "bias")])
def test_fp8_gemm_matches_quantized_operands(dtype, block, m, fusion):
    """More than SKINNY_MAX_M rows: x quantized per token (per-channel weights) or per token and
    group of bk columns (block-wise), both operands multiplied in fp8; against the same quantization
    in float64."""
    torch.manual_seed(1)
    k, n = 320, 200  # partial K block, partial N tile, several M tiles at m = 130
    x = torch.randn(m, k).to(dtype)
    x[3] = 0.0  # a zero row's scale is 1, not 0/0
    out, ref = check_linear(x, n, block, fusion,
                            tol=max(TOLERANCE[dtype], FP8_MMA_TOLERANCE) if CUDA else None)
    assert float((out[3] - ref[3]).abs().max()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() != (9, 0),
                    reason="cuBLAS's block-wise fp8 scaling: sm_90")
@pytest.mark.parametrize("block", [(128, 128), None])
@pytest.mark.parametrize("m,fusion", [(17, "residual"), (64, "silu_mul"), (65, "bias"),
                                      (300, "none")])
def test_fp8_linear_through_scaled_mm_matches_quantized_operands(block, m, fusion):
    """Rows past SKINNY_MAX_M (block-wise) or from SCALED_MM_CHANNEL_M on (per-channel) go to
    torch._scaled_mm, with the same activation quantization as our GEMM and its fusions done after;
    against the quantized operands in float64. Rows not a multiple of 4 (cuBLAS refuses those
    scales) included; the weight's blocks differ in scale by up to 2**8, so a misread scale shows.
    Block-wise weights with 5 blocks in K (cuBLAS read those wrong), and per-channel ones with K
    under SCALED_MM_CHANNEL_K, stay on our GEMM."""
    torch.manual_seed(6)
    k, n = (512 if block else triton_fp8.SCALED_MM_CHANNEL_K), 384
    x = torch.randn(m, k).to(torch.bfloat16)
    w_fp8, _, _ = quantize(torch.randn(n, k), block)
    expected = m > triton_fp8.SKINNY_MAX_M if block else m >= triton_fp8.SCALED_MM_CHANNEL_M
    assert triton_fp8.uses_scaled_mm(x.to(DEVICE), w_fp8, block) == expected
    five_blocks, _, _ = quantize(torch.randn(n, 640), block)  # per-channel: K under 4096 too
    assert not triton_fp8.uses_scaled_mm(torch.randn(m, 640, device=DEVICE, dtype=torch.bfloat16),
                                         five_blocks, block)
    check_linear(x, n, block, fusion, tol=max(TOLERANCE[torch.bfloat16], FP8_MMA_TOLERANCE),
                 spread=True)


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_skinny_reads_no_scales_past_k(per_channel):
    """K = 320 in steps of 256: the second step's second chunk starts past K. Its weight block
    scales (and x's) do not exist: read anyway, whatever follows them in memory (here NaN) made the
    whole row NaN (0 * NaN), as uninitialized memory did on the GPU in a full test run."""
    torch.manual_seed(4)
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = torch.randn(5, 320).to(dtype)
    block = None if per_channel else (128, 128)
    w_fp8, scale, w_ref = quantize(torch.randn(96, 320) * 0.1, block)
    padded = torch.full((scale.size(0), scale.size(1) + 1), float("nan"), device=DEVICE)
    padded[:, :-1] = scale
    config = dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=2)
    out = triton_fp8.fp8_skinny(x.to(DEVICE), w_fp8, padded[:, :-1], block, None, None, False,
                                config=config)
    ref = quantize_groups(x, 320 if per_channel else 128) @ w_ref.T
    assert not out.isnan().any()
    assert float((out.double().cpu() - ref).norm() / ref.norm()) < max(TOLERANCE[dtype],
                                                                       FP8_MMA_TOLERANCE)
