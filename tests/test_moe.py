"""Specification of Qwen3-MoE (``Qwen3MoeForCausalLM``) and its fused MoE kernel.

The model: tiny random checkpoints built by transformers in Qwen3-MoE's configurations (8 experts,
top-2; norm_topk_prob on and off; dense layers mixed in by mlp_only_layers and decoder_sparse_step)
give transformers' greedy output token for token on CPU, with prefix-cache hits, chunked prefill and
preemption; the checkpoint's experts load from either layout (per expert, as the Hub and
save_pretrained write them, or packed 3-D tensors), and a checkpoint that lacks an expert's tensor
is refused by name; dummy weights; the Qwen3-30B-A3B preset's parameter count. TP=2 is in
test_tensor_parallel.py.

The kernel: ``triton_moe.fused_moe`` against ``moe_reference.fused_moe`` (computed in float64) under
TRITON_INTERPRET=1 at small shapes, in fp32 and fp16, with skewed and uniform routing; its alignment
step's invariants; at Qwen3-30B-A3B's shapes in bf16 and inside a CUDA graph on the GPU.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    assert_matches_oracle,
    edited_checkpoint,
    generate_with_features,
    random_prompts,
    run_engine,
)
from safetensors.torch import load_file, save_file
from tiny_model import build_tiny_model

from nanovllm import LLM, SamplingParams
from nanovllm.features.fp8 import FP8, quantize_fp8_block
from nanovllm.kernels import moe_reference

triton_moe = pytest.importorskip("nanovllm.kernels.triton_moe")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
N = 24

MOE = dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CHECKPOINTS = {  # name: build_tiny_model("qwen3_moe") overrides
    # a dense layer (mlp_only_layers) between sparse ones, renormalized top-k (Qwen3-30B-A3B's
    # norm_topk_prob)
    "topk_norm_mixed": dict(MOE, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1]),
    # every other layer sparse (decoder_sparse_step 2), top-k weights as the softmax gives them,
    # tied embeddings
    "topk_raw_step2": dict(MOE, norm_topk_prob=False, num_hidden_layers=4, decoder_sparse_step=2,
                           num_experts_per_tok=3, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: build_tiny_model(str(root / name), "qwen3_moe", **kw)
            for name, kw in CHECKPOINTS.items()}


# ---- the model against transformers --------------------------------------------------------------
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_qwen3_moe_matches_transformers(moe_checkpoints, oracle, name):
    """With prefix-cache hits (a second wave sharing the first's prefixes), chunked prefill (a
    40-token budget) and preemption (a 40-block cache), as every family's test runs."""
    path = moe_checkpoints[name]

    def check(llm):
        layers = llm.model_runner.model.model.layers
        sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in layers]
        assert sparse == {"topk_norm_mixed": [True, False, True],
                          "topk_raw_step2": [False, True, False, True]}[name]
    prompts, outputs = generate_with_features(path, random_prompts(12, 3, 90, seed=80), N, check)
    assert_matches_oracle(oracle, path, prompts, outputs, N)


def _pack_experts(src: str, dst) -> str:
    """A copy of checkpoint ``src`` whose experts are packed per layer as transformers holds them in
    memory: experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and experts.down_proj [E, H,
    I]."""
    import shutil
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        experts = json.load(f)["num_local_experts"]  # what Qwen3MoeConfig saves num_experts as
    for prefix in sorted({n.split("experts.")[0] for n in tensors if ".experts." in n}):
        gate, up, down = ([tensors.pop(f"{prefix}experts.{e}.{proj}.weight")
                           for e in range(experts)]
                          for proj in ("gate_proj", "up_proj", "down_proj"))
        tensors[f"{prefix}experts.gate_up_proj"] = torch.stack([torch.cat([g, u])
                                                                for g, u in zip(gate, up)])
        tensors[f"{prefix}experts.down_proj"] = torch.stack(down)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_packed_expert_layout_loads_the_same_model(moe_checkpoints, oracle, tmp_path):
    """save_pretrained writes one tensor per expert (the Hub's layout, which the test above loads);
    the packed 3-D layout must give the same model, hence the same greedy tokens. transformers reads
    the packed copy as the same model too (so gate rows come first, as packed here)."""
    path = moe_checkpoints["topk_norm_mixed"]
    assert any(".experts.0.gate_proj.weight" in n
               for n in load_file(os.path.join(path, "model.safetensors")))
    packed = _pack_experts(path, tmp_path / "packed")
    ids = torch.tensor([[1, 5, 9, 200, 33]])
    with torch.no_grad():
        assert torch.equal(oracle.model(packed)(ids).logits, oracle.model(path)(ids).logits)
    prompts = random_prompts(4, 5, 40, seed=81)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    per_expert, _ = run_engine(path, prompts, sp, device="cpu", num_kvcache_blocks=64)
    from_packed, _ = run_engine(packed, prompts, sp, device="cpu", num_kvcache_blocks=64)
    assert [o["token_ids"] for o in from_packed] == [o["token_ids"] for o in per_expert]


def test_missing_or_misshapen_expert_is_named(moe_checkpoints, tmp_path):
    path = moe_checkpoints["topk_norm_mixed"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    dropped = edited_checkpoint(path, tmp_path / "dropped")
    save_file({n: t for n, t in tensors.items()
               if n != "model.layers.2.mlp.experts.5.up_proj.weight"},
              os.path.join(dropped, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts \(expert 5 w3\)"):
        LLM(dropped, device="cpu", num_kvcache_blocks=16)
    bad = edited_checkpoint(path, tmp_path / "bad")
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    save_file({**tensors, name: tensors[name][:, :-1].contiguous()},
              os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError,
                       match=rf"{name}.*has shape \(64, 31\) but the model expects \(64, 32\)"):
        LLM(bad, device="cpu", num_kvcache_blocks=16)
    extra = edited_checkpoint(path, tmp_path / "extra")
    save_file({**tensors, "model.layers.0.mlp.experts.8.up_proj.weight":
               tensors[name.replace("down", "up")].clone()},
              os.path.join(extra, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError,
                       match=r"experts\.8\.up_proj.*is expert 8 but the model has 8 experts"):
        LLM(extra, device="cpu", num_kvcache_blocks=16)


def test_dummy_weights_and_bad_configs(moe_checkpoints, tmp_path):
    path = moe_checkpoints["topk_norm_mixed"]
    llm = LLM(path, load_format="dummy", device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
    try:
        experts = llm.model_runner.model.model.layers[0].mlp.experts
        assert (experts.w13_weight.std() == pytest.approx(0.02, rel=0.1)
                and experts.w2_weight.abs().sum() > 0)
        out = llm.generate([[1, 2, 3]],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0]["token_ids"]) == 4
    finally:
        llm.exit()
    odd = edited_checkpoint(path, tmp_path / "odd", moe_intermediate_size=33)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the model's "
                                         "moe_intermediate_size=33"):
        LLM(odd, device="cpu", tensor_parallel_size=2)
    from nanovllm.config import (
        Config,  # the checks alone (no engine): the dense MLP's size matters only if built
    )
    Config(edited_checkpoint(path, tmp_path / "sparse", mlp_only_layers=[], intermediate_size=33),
           tensor_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="must divide the model's intermediate_size=33"):
        Config(edited_checkpoint(path, tmp_path / "dense", intermediate_size=33),
               tensor_parallel_size=2, device="cpu")
    many = edited_checkpoint(path, tmp_path / "many", num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"):
        LLM(many, device="cpu")
    with pytest.raises(ValueError,
                       match="enable_expert_parallel=True.*sharded along their intermediate size"):
        # vLLM's expert parallelism: not honoured, so refused
        LLM(path, device="cpu", enable_expert_parallel=True)
    LLM(path, device="cpu", enable_expert_parallel=False, num_kvcache_blocks=16).exit()


def test_dummy_router_is_the_same_on_every_rank(moe_checkpoints):
    """Under TP each rank draws its own dummy shards (seed + rank), but the router, whole on every
    rank, must route alike on all of them: rank 0's values everywhere."""
    from transformers import AutoConfig

    from nanovllm.features.moe import Qwen3MoeForCausalLM
    from nanovllm.models.presets import load_dummy_weights
    from nanovllm.utils.distributed import tensor_parallel
    config = AutoConfig.from_pretrained(moe_checkpoints["topk_norm_mixed"])
    ranks = []
    for rank in range(2):
        with tensor_parallel(rank, 2):
            model = Qwen3MoeForCausalLM(config, 64)
        load_dummy_weights(model, 7 + rank)
        ranks.append([layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")])
    assert len(ranks[0]) >= 2
    for a, b in zip(*ranks):
        assert torch.equal(a.gate.weight, b.gate.weight)
        # shards stay the rank's own
        assert not torch.equal(a.experts.w13_weight, b.experts.w13_weight)
    # each layer routes its own way
    assert not torch.equal(ranks[0][0].gate.weight, ranks[0][1].gate.weight)


def test_qwen3_30b_a3b_preset_builds():
    """The preset's config builds (meta device) with Qwen3-30B-A3B's 30.5B parameters, all 48 layers
    sparse."""
    from nanovllm.models import get_model_class
    from nanovllm.models.presets import preset_config
    from nanovllm.utils.distributed import tensor_parallel
    config = preset_config("qwen3-30b-a3b")
    with torch.device("meta"), tensor_parallel(0, 1):
        model = get_model_class(config)(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(30.53, abs=0.01)
    assert all(tuple(layer.mlp.experts.w13_weight.shape) == (128, 1536, 2048)
               for layer in model.model.layers)


# ---- the kernel against the reference ------------------------------------------------------------
def _route(m: int, experts: int, top_k: int, g: torch.Generator, skew: bool):
    logits = torch.randn(m, experts, generator=g)
    # most tokens to two experts: runs of many tiles for one expert, most experts untouched
    if skew:
        logits[:, 3] += 8.0
        logits[:, 5] += 7.0
    return moe_reference.fused_topk(logits.to(DEVICE), top_k, renormalize=True)


def _moe_inputs(m: int, hidden: int, inter: int, experts: int, top_k: int, dtype, seed: int,
                skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g)
           / hidden ** 0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(DEVICE)
    return (x, w13, w2, *_route(m, experts, top_k, g, skew))


def _check_fused_moe(m, hidden, inter, experts, top_k, dtype, seed=0, skew=False, config=None,
                     residual=False):
    x, w13, w2, tw, ti = _moe_inputs(m, hidden, inter, experts, top_k, dtype, seed, skew)
    ref = moe_reference.fused_moe(x.double(), w13.double(), w2.double(), tw, ti)
    res = torch.randn(m, hidden, device=DEVICE).to(dtype) if residual else None
    if residual:
        ref = ref + res.double()
    out = triton_moe.fused_moe(x, w13, w2, tw, ti, residual=res.clone() if residual else None,
                               config=config)
    assert out.shape == (m, hidden) and not out.isnan().any()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < TOL[dtype], err


# several tiles of N and K
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,skew,residual",
                         [(1, False, False), (7, False, True), (40, True, False)],
                         ids=["decode1", "batch7_residual", "skewed40"])
def test_fused_moe_matches_reference(m, skew, residual, dtype):
    """I = 48: a partial column tile; skewed routing puts ~40 rows on one expert (three tiles of
    16)."""
    _check_fused_moe(m, 64, 48, 8, 2, dtype, seed=m, skew=skew, config=SMALL, residual=residual)


# (experts, top_k, block, token counts): 300 x 4 pairs take the kernel two chunks of 1024; on the
# GPU also Qwen3-30B-A3B's routing at a prefill's size (32 chunks, pairs racing for 128 cursors)
ALIGN_CASES = [(16, 4, 16, (1, 5, 33, 300))] + ([(128, 8, 64, (1, 256, 4096))] if CUDA else [])


@pytest.mark.parametrize("experts,top_k,block,sizes", ALIGN_CASES)
def test_moe_align_block_size_invariants(experts, top_k, block, sizes):
    """Every (token, slot) pair once, in a tile of its expert's; tiles padded with the sentinel; the
    padded total covers exactly the experts' runs rounded up to the block; tiles past it are
    num_experts."""
    g = torch.Generator().manual_seed(3)
    for m in sizes:
        topk_ids = torch.stack([torch.randperm(experts, generator=g)[:top_k]
                                for _ in range(m)]).to(DEVICE)
        sorted_ids, expert_ids, total = triton_moe.moe_align_block_size(topk_ids, block, experts)
        pairs = m * top_k
        counts = torch.bincount(topk_ids.flatten().cpu(), minlength=experts)
        assert int(total) == int(((counts + block - 1) // block * block).sum())
        assert sorted_ids.numel() == expert_ids.numel() * block >= int(total)
        real = sorted_ids[sorted_ids < pairs].cpu()
        assert sorted(real.tolist()) == list(range(pairs))
        tiles = sorted_ids.view(-1, block).cpu()
        for t, expert in enumerate(expert_ids.cpu().tolist()):
            rows = tiles[t][tiles[t] < pairs]
            if t * block >= int(total):
                assert expert == experts and rows.numel() == 0
            else:
                assert (topk_ids.flatten().cpu()[rows] == expert).all()


@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_topk_kernel_matches_reference(renormalize):
    """The softmax's top-k (weights and experts, in order), renormalized or not, for 128 and 6
    experts."""
    g = torch.Generator().manual_seed(4)
    for m, experts, top_k in ((5, 128, 8), (3, 6, 3)):
        logits = torch.randn(m, experts, generator=g).to(DEVICE)
        w, ids = triton_moe.fused_topk(logits, top_k, renormalize)
        probs = torch.softmax(logits.double(), -1)
        ref_w, ref_ids = probs.topk(top_k)
        if renormalize:
            ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        assert torch.equal(ids.long(), ref_ids) and torch.allclose(w.double(), ref_w, atol=1e-6)
        ref_w32, ref_ids32 = moe_reference.fused_topk(logits, top_k, renormalize)
        assert (torch.equal(ref_ids32, ref_ids)
                and torch.allclose(ref_w32.double(), ref_w, atol=1e-6))


# ---- fp8 experts: e4m3 weights with block scales, against the reference on the same weights
# dequantized --------------------------------------------------------------------------------------
def _fp8_experts(experts: int, n: int, k: int, block: tuple[int, int], g: torch.Generator):
    """(e4m3 weights [E, n, k], scales [E, ceil(n / bn), ceil(k / bk)]) of random weights whose
    blocks differ in magnitude by up to 2^8 (so a scale read from the wrong block, row or expert
    changes the result)."""
    bn, bk = block
    factor = 2.0 ** torch.randint(-4, 5, (experts, -(-n // bn), -(-k // bk)), generator=g).float()
    w = torch.randn(experts, n, k, generator=g).to(DEVICE) / k ** 0.5
    w *= factor.to(DEVICE).repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k]
    quantized = [quantize_fp8_block(w[e], block) for e in range(experts)]
    return torch.stack([q for q, _ in quantized]), torch.stack([s for _, s in quantized])


def _fp8_moe_inputs(m, hidden, inter, experts, top_k, block, dtype, seed, skew=False):
    """x, the fp8 experts, the routing, and the scales and block as ``fused_moe``'s keywords."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype).to(DEVICE)
    w13, s13 = _fp8_experts(experts, 2 * inter, hidden, block, g)
    w2, s2 = _fp8_experts(experts, hidden, inter, block, g)
    return (x, w13, w2, *_route(m, experts, top_k, g, skew),
            dict(w13_scale=s13, w2_scale=s2, block_shape=block))


def _fp8_error(x, w13, w2, tw, ti, fp8, residual=None, config=None, kernel_fp8=None, w8a8=True):
    """The kernel's relative error against the reference: W8A16 in float64 (the experts dequantized
    exactly), W8A8 in x's dtype (the activations' e4m3 rounding depends on the intermediate's
    rounding to x's dtype, which the reference then does as the kernel does); ``kernel_fp8``: other
    scales for the kernel alone."""
    ref = moe_reference.fused_moe(x if w8a8 else x.double(), w13, w2, tw, ti, w8a8=w8a8,
                                  **fp8).double()
    if residual is not None:
        ref = ref + residual.double()
    out = triton_moe.fused_moe(x, w13, w2, tw, ti,
                               residual=None if residual is None else residual.clone(),
                               config=config, w8a8=w8a8, **(kernel_fp8 or fp8))
    assert out.shape == x.shape and out.dtype == x.dtype and not out.isnan().any()
    return float((out.double() - ref).norm() / ref.norm())


# (hidden, inter, block, tiles): hidden 80 leaves a partial block in K (w13) and in N (w2); the
# first case steps through each 64-column block of the scales in two K steps of 32, its 64-row
# blocks in column tiles of 32; the second's 64-wide tiles span four 16-row blocks, its K steps cut
# to one 32-column block, I = 48 a partial K block
FP8_CASES = {"bn64_bk64_tiles32": (80, 64, (64, 64), SMALL),
             "bn16_bk32_tiles64": (80, 48, (16, 32),
                                   dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4,
                                                           num_stages=2))}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,skew,residual",
                         [(1, False, False), (7, False, True), (40, True, False)],
                         ids=["decode1", "batch7_residual", "skewed40"])
@pytest.mark.parametrize("case", list(FP8_CASES))
@pytest.mark.parametrize("w8a8", [True, False], ids=["w8a8", "w8a16"])
def test_fp8_fused_moe_matches_dequantized_reference(w8a8, case, m, skew, residual, dtype):
    """8 experts, top-2; skewed routing puts ~40 rows (three tiles of 16) on one expert."""
    hidden, inter, block, config = FP8_CASES[case]
    x, w13, w2, tw, ti, fp8 = _fp8_moe_inputs(m, hidden, inter, 8, 2, block, dtype, seed=m,
                                              skew=skew)
    res = torch.randn(m, hidden, device=DEVICE).to(dtype) if residual else None
    assert _fp8_error(x, w13, w2, tw, ti, fp8, res, config, w8a8=w8a8) < TOL[dtype]


@pytest.mark.parametrize("w8a8", [True, False], ids=["w8a8", "w8a16"])
def test_fp8_fused_moe_default_tiles_step_through_whole_128_blocks(w8a8):
    """config=None with 128x128 blocks: ``moe_config`` gives K steps of 128 (the tiles the H200
    sweep chose), through two blocks of K and two of N."""
    assert triton_moe.moe_config(5, 8, 2, (128, 128))["BLOCK_K"] == 128
    x, w13, w2, tw, ti, fp8 = _fp8_moe_inputs(5, 256, 128, 8, 2, (128, 128), torch.float32,
                                              seed=21)
    assert _fp8_error(x, w13, w2, tw, ti, fp8, w8a8=w8a8) < TOL[torch.float32]


def test_fp8_fused_moe_w8a8_quantizes_the_activations():
    """W8A8 and W8A16 differ by the activations' e4m3 rounding (~2-3%), far past float32's
    tolerance: each route's kernel matches its own reference and not the other's."""
    hidden, inter, block, config = FP8_CASES["bn64_bk64_tiles32"]
    x, w13, w2, tw, ti, fp8 = _fp8_moe_inputs(7, hidden, inter, 8, 2, block, torch.float32, seed=5)
    for w8a8 in (True, False):
        out = triton_moe.fused_moe(x, w13, w2, tw, ti, config=config, w8a8=w8a8, **fp8).double()
        errors = {}
        for ref_w8a8 in (True, False):
            ref = moe_reference.fused_moe(x, w13, w2, tw, ti, w8a8=ref_w8a8, **fp8).double()
            errors[ref_w8a8] = float((out - ref).norm() / ref.norm())
        assert errors[w8a8] < TOL[torch.float32], (w8a8, errors)
        assert errors[not w8a8] > 1e-3, (w8a8, errors)


def test_fp8_fused_moe_reads_each_blocks_own_scale():
    """A mutation check: the kernel given the scales of the neighbouring expert, row block or column
    block (what a wrong index would read) misses the reference by far more than the tolerance, so
    the test above would fail."""
    hidden, inter, block, config = FP8_CASES["bn64_bk64_tiles32"]
    x, w13, w2, tw, ti, fp8 = _fp8_moe_inputs(7, hidden, inter, 8, 2, block, torch.float32, seed=9)
    assert _fp8_error(x, w13, w2, tw, ti, fp8, config=config) < TOL[torch.float32]
    for dim in (0, 1, 2):
        wrong = dict(fp8, w13_scale=fp8["w13_scale"].roll(1, dim).contiguous(),
                     w2_scale=fp8["w2_scale"].roll(1, dim).contiguous())
        assert _fp8_error(x, w13, w2, tw, ti, fp8, config=config,
                          kernel_fp8=wrong) > 100 * TOL[torch.float32], dim


def test_fp8_fused_moe_block_the_kernel_cannot_step_through():
    """bk = 48 (not a power of two): the experts are dequantized first, then the same kernel; same
    result."""
    x, w13, w2, tw, ti, fp8 = _fp8_moe_inputs(5, 96, 48, 4, 2, (16, 48), torch.float32, seed=11)
    assert _fp8_error(x, w13, w2, tw, ti, fp8, config=SMALL) < TOL[torch.float32]


@pytest.mark.parametrize("fused_moe", [moe_reference.fused_moe, triton_moe.fused_moe],
                         ids=["reference", "triton"])
def test_fp8_fused_moe_refuses_missing_or_misshapen_scales(fused_moe):
    x, w13, w2, tw, ti, fp8 = _fp8_moe_inputs(3, 64, 32, 4, 2, (32, 32), torch.float32, seed=12)
    with pytest.raises(ValueError,
                       match="need w13_scale, w2_scale and block_shape; got w13_scale, w2_scale"):
        fused_moe(x, w13, w2, tw, ti, w13_scale=fp8["w13_scale"], w2_scale=fp8["w2_scale"])
    with pytest.raises(ValueError,
                       match=r"w13_scale is torch.float32 \(4, 2, 2\) but experts \(4, 64, 64\) "
                             r"with block_shape \(32, 16\) need float32 \(4, 2, 4\)"):
        fused_moe(x, w13, w2, tw, ti, **dict(fp8, block_shape=(32, 16)))
    with pytest.raises(ValueError,
                       match=r"w2_scale is torch.float32 \(4, 1, 1\) but experts \(4, 64, 32\) "
                             r"with block_shape \(32, 32\) need float32 \(4, 2, 1\)"):
        fused_moe(x, w13, w2, tw, ti, **dict(fp8, w2_scale=fp8["w2_scale"][:, :1, :1]))
    dense = w13.float(), w2.float()
    with pytest.raises(ValueError, match="w13_scale, w2_scale, block_shape given but the experts "
                                         "are torch.float32"):
        fused_moe(x, *dense, tw, ti, **fp8)
    with pytest.raises(TypeError, match="w13 is torch.float8_e4m3fn but w2 is torch.float32"):
        fused_moe(x, w13, dense[1], tw, ti, **fp8)


def test_fused_moe_layer_hands_its_fp8_experts_to_the_kernel(monkeypatch):
    """FusedMoE of a block-wise fp8 model passes the e4m3 experts, their scales and block to the
    kernel (no dequantized copy), which gives the reference layer's output."""
    from nanovllm.features import moe as layer_module
    from nanovllm.features.fp8 import Fp8Config, quantization
    from nanovllm.features.moe import FusedMoE
    with quantization(Fp8Config(True, (32, 32))):
        layer = FusedMoE(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64,
                         renormalize=True)
    g = torch.Generator().manual_seed(13)
    for name, (n, k) in (("w13", (128, 64)), ("w2", (64, 64))):
        w, s = _fp8_experts(4, n, k, (32, 32), g)
        getattr(layer, f"{name}_weight").data.copy_(w)
        getattr(layer, f"{name}_weight_scale_inv").data.copy_(s)
    layer.to(DEVICE)
    x = torch.randn(6, 64, generator=g).to(DEVICE)
    logits = torch.randn(6, 4, generator=g).to(DEVICE)
    ref = layer(x, logits) if not CUDA else None
    seen = []

    def spy(*args, **kw):
        seen.append((args[1].dtype, args[2].dtype, kw["block_shape"]))
        return triton_moe.fused_moe(*args, **kw)
    ops = SimpleNamespace(fused_topk=triton_moe.fused_topk, fused_moe=spy)
    monkeypatch.setattr(layer_module, "moe_ops", lambda x: ops)
    out = layer(x, logits)
    assert seen == [(FP8, FP8, (32, 32))]
    tw, ti = moe_reference.fused_topk(logits, 2, True)
    expected = moe_reference.fused_moe(x.double(), layer.w13_weight, layer.w2_weight, tw, ti,
                                       w13_scale=layer.w13_weight_scale_inv,
                                       w2_scale=layer.w2_weight_scale_inv, block_shape=(32, 32))
    assert float((out.double() - expected).norm() / expected.norm()) < TOL[torch.float32]
    if ref is not None:  # the CPU layer (the reference path) agrees too
        assert float((ref.double() - expected).norm() / expected.norm()) < TOL[torch.float32]


# ---- on the GPU: Qwen3-30B-A3B's shapes, CUDA graphs, the engine ---------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 256, 2048])
def test_fused_moe_at_qwen3_30b_a3b_shapes(m):
    """H 2048, I 768, 128 experts, top-8, bf16, with the default tile sizes of each batch size."""
    _check_fused_moe(m, 2048, 768, 128, 8, torch.bfloat16, seed=m, residual=m == 64)


@pytest.fixture(scope="module")
def qwen3_30b_fp8_experts():
    """Qwen3-30B-A3B-FP8's experts: 128 of H 2048 x I 768 in e4m3 with 128x128 blocks, built
    once."""
    g = torch.Generator().manual_seed(30)
    w13, s13 = _fp8_experts(128, 2 * 768, 2048, (128, 128), g)
    w2, s2 = _fp8_experts(128, 2048, 768, (128, 128), g)
    return w13, w2, dict(w13_scale=s13, w2_scale=s2, block_shape=(128, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 2048])
def test_fp8_fused_moe_at_qwen3_30b_a3b_shapes(qwen3_30b_fp8_experts, m):
    """Top-8 of the 128 experts, x in bf16, the default tiles of each batch size; the reference
    dequantizes the experts in float64."""
    w13, w2, fp8 = qwen3_30b_fp8_experts
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 2048, generator=g).to(torch.bfloat16).to(DEVICE)
    res = torch.randn(m, 2048, generator=g).to(torch.bfloat16).to(DEVICE) if m == 64 else None
    tw, ti = _route(m, 128, 8, g, skew=False)
    assert _fp8_error(x, w13, w2, tw, ti, fp8, res) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_moe_in_a_cuda_graph(fp8):
    """Captured once, replayed on new routing (as decode graphs replay): the same values as eager
    calls; with bf16 experts and with fp8 ones (128x128 blocks)."""
    x, w13, w2, tw, ti = _moe_inputs(48, 256, 128, 32, 4, torch.bfloat16, seed=5)
    scales = {}
    if fp8:
        g = torch.Generator().manual_seed(7)
        (w13, s13), (w2, s2) = (_fp8_experts(32, 256, 256, (128, 128), g),
                                _fp8_experts(32, 256, 128, (128, 128), g))
        scales = dict(w13_scale=s13, w2_scale=s2, block_shape=(128, 128))
    eager = triton_moe.fused_moe(x, w13, w2, tw, ti, **scales)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_moe(x, w13, w2, tw, ti, **scales)
    graph.replay()
    assert torch.equal(out, eager)
    x2, _, _, tw2, ti2 = _moe_inputs(48, 256, 128, 32, 4, torch.bfloat16, seed=6)
    for dst, src in ((x, x2), (tw, tw2), (ti, ti2)):
        dst.copy_(src)
    graph.replay()
    assert torch.equal(out, triton_moe.fused_moe(x, w13, w2, tw, ti, **scales))


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_qwen3_moe_float32_on_cuda_matches_transformers(moe_checkpoints, oracle, enforce_eager):
    path = moe_checkpoints["topk_norm_mixed"]
    prompts = random_prompts(21, 3, 90, seed=82)  # graph bucket 32, padded rows
    outputs, _ = run_engine(path, prompts,
                            SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                            device="cuda", dtype="float32", enforce_eager=enforce_eager)
    assert_matches_oracle(oracle, path, prompts, outputs, N)
