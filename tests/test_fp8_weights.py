"""Specification of fp8 weights on CPU: a block-wise fp8 checkpoint written by
tools/quantize_fp8.py, and ``quantization="fp8"`` on a float checkpoint, give the greedy tokens and
logprobs of transformers running the same weights quantized and dequantized (TP=1 and TP=2); bad
scales and unsplittable layers are refused by name."""
from __future__ import annotations

import json
import os
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import CPU_ENGINE, assert_matches_oracle, random_prompts, run_engine
from safetensors.torch import load_file, save_file
from tiny_model import build_tiny_qwen3
from transformers import AutoConfig

from nanovllm import LLM, SamplingParams
from nanovllm.features.fp8 import (
    FP8,
    dequantize_fp8_block,
    get_quantization_config,
    quantization,
    quantize_fp8_block,
    quantize_fp8_per_channel,
    skip_unconverted_layers,
)
from nanovllm.layers.linear import LinearMethod
from nanovllm.models import get_model_class
from nanovllm.utils import loader
from nanovllm.utils.distributed import tensor_parallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from quantize_fp8 import PROJECTION, quantize_checkpoint  # noqa: E402

# the tiny model's q/k/v (128/64/64 rows) and gate/up (128) split into 32-row blocks, also per rank
BLOCK = 32
N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory) -> str:
    return build_tiny_qwen3(str(tmp_path_factory.mktemp("fp8") / "float"), head_dim=32,
                            hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2)


@pytest.fixture(scope="module")
def fp8_ckpt(float_ckpt, tmp_path_factory) -> str:
    return quantize_checkpoint(float_ckpt, str(tmp_path_factory.mktemp("fp8") / "block"), BLOCK)


def roundtrip_copy(src: str, dst: str, roundtrip) -> str:
    """A float copy of ``src`` whose projections are ``roundtrip(w)``: the weights an fp8 engine
    computes with."""
    from tiny_model import build_byte_tokenizer
    build_byte_tokenizer(dst)
    for name in os.listdir(src):
        if name.endswith(".json"):
            with open(os.path.join(src, name)) as f, open(os.path.join(dst, name), "w") as g:
                g.write(f.read())
    weights = load_file(os.path.join(src, "model.safetensors"))
    save_file({n: roundtrip(w) if PROJECTION.fullmatch(n) else w for n, w in weights.items()},
              os.path.join(dst, "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def block_oracle_ckpt(float_ckpt, tmp_path_factory) -> str:
    block = (BLOCK, BLOCK)
    return roundtrip_copy(float_ckpt, str(tmp_path_factory.mktemp("fp8") / "block_dq"),
                          lambda w: dequantize_fp8_block(*quantize_fp8_block(w, block), block))


def test_block_roundtrip_bounds_the_error():
    w = torch.randn(70, 45) * torch.logspace(-3, 1, 45)
    q, scale = quantize_fp8_block(w, (32, 16))
    assert q.dtype == FP8 and scale.shape == (3, 3)
    back = dequantize_fp8_block(q, scale, (32, 16))
    assert ((back - w).abs() <= 2 ** -4 * w.abs() + scale.max() * 2 ** -9).all()
    assert torch.equal(dequantize_fp8_block(*quantize_fp8_block(torch.zeros(4, 4))),
                       torch.zeros(4, 4))


def test_the_tool_writes_the_fp8_layout(fp8_ckpt):
    with open(os.path.join(fp8_ckpt, "config.json")) as f:
        assert json.load(f)["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3",
                                                       "activation_scheme": "dynamic",
                                                       "weight_block_size": [BLOCK, BLOCK]}
    weights = load_file(os.path.join(fp8_ckpt, "model.safetensors"))
    assert weights["model.layers.0.self_attn.k_proj.weight"].dtype == FP8
    assert (weights["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape
            == (64 // BLOCK, 64 // BLOCK))
    assert weights["model.layers.1.mlp.down_proj.weight_scale_inv"].dtype == torch.float32
    assert weights["model.embed_tokens.weight"].dtype == torch.float32
    assert os.path.isfile(os.path.join(fp8_ckpt, "tokenizer.json"))


# Quantized activations make a forward discontinuous: an ulp between two correct implementations
# (fused ops, another matmul blocking, TP's reductions, a batch of another size) now and then moves
# an activation across an e4m3 rounding boundary, a step of 1/16 to 1/8 of it. So the W8A8
# comparisons hold 90% of the logprobs to float32's noise and bound the rest by what such steps
# moved here (up to 0.23 in a logprob on these random models, 0.03 in a top-2 gap), with a margin. A
# wrong scale or shard moves every logprob by far more.
W8A8_TYPICAL, W8A8_WORST, W8A8_TIE = 1e-4, 0.5, 5e-2


def assert_w8a8_matches(oracle, path: str, model, prompts, outputs, logprob_outputs):
    """Greedy tokens under the near-tie rule at W8A8_TIE, and every prompt's logprobs (the actual
    token and the top 3): 90% within W8A8_TYPICAL, all within W8A8_WORST, against transformers'
    ``model`` of ``path``."""
    assert_matches_oracle(oracle, path, prompts, outputs, N, max_near_ties=len(prompts) // 4,
                          tie=W8A8_TIE)
    diffs = []
    with torch.no_grad():
        for prompt, out in zip(prompts, logprob_outputs, strict=True):
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
            for pos in range(1, len(prompt)):
                entry = out.prompt_logprobs[pos]
                assert prompt[pos] in entry and len(entry) in (3, 4), (pos, entry)
                diffs += [abs(lp.logprob - float(ref[pos - 1, t])) for t, lp in entry.items()]
    diffs = torch.tensor(diffs)
    typical = float((diffs < W8A8_TYPICAL).double().mean())
    assert typical >= 0.9 and diffs.max() < W8A8_WORST, (typical, diffs.max())


def generate_both(path: str, prompts, model_check=None, **kw):
    """(greedy outputs, prompt-logprob outputs) of ``prompts`` from one engine;
    ``model_check(model)`` first at TP 1."""
    llm = LLM(path, **CPU_ENGINE, dtype="float32", **kw)
    try:
        if model_check is not None and kw.get("tensor_parallel_size", 1) == 1:
            model_check(llm.model_runner.model.model)
        batch = [{"prompt_token_ids": p} for p in prompts]
        greedy = [{"token_ids": o.outputs[0].token_ids}
                  for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        return greedy, llm.generate(batch, SamplingParams(max_tokens=1, prompt_logprobs=3),
                                    use_tqdm=False)
    finally:
        llm.exit()


@pytest.mark.parametrize("tp", [1, 2])
def test_block_fp8_checkpoint_matches_transformers_on_the_dequantized_weights(
        fp8_ckpt, block_oracle_ckpt, oracle, tp):
    model = fake_quantized_activations(oracle.model(block_oracle_ckpt), group=BLOCK)
    prompts = random_prompts(8, 3, 40, seed=11)
    def model_check(m):
        layer = m.layers[0].mlp.gate_up_proj
        assert (layer.weight.dtype == FP8
                and layer.weight_scale_inv.shape == (256 // BLOCK, 64 // BLOCK))
    greedy, logprobs = generate_both(fp8_ckpt, prompts, model_check, tensor_parallel_size=tp)
    assert_w8a8_matches(oracle, block_oracle_ckpt, model, prompts, greedy, logprobs)


def fake_quantized_activations(model, row_shards: int = 1, group: int | None = None):
    """Hooks giving each dense projection of a transformers model its input quantized to e4m3 and
    back, as the fp8 forward computes: per token (online fp8; row-parallel layers, o and down,
    quantize each rank's ``row_shards`` part apart) or per token and ``group`` of columns
    (block-wise: a rank's part is whole groups); Qwen3-MoE's experts (packed, no projection modules)
    run a copy of their loop that quantizes x and the intermediate (block-wise MoE is W8A8). Once a
    model."""
    def dequantized(x):
        x2 = x.reshape(-1, x.size(-1))
        shape = (1, group or x2.size(1))
        return dequantize_fp8_block(*quantize_fp8_block(x2, shape), shape).view_as(x)

    def hook(shards):
        return lambda module, args: (
            torch.cat([dequantized(p) for p in args[0].chunk(shards, -1)], -1),)
    def experts_forward(experts, hidden_states, top_k_index, top_k_weights):
        """transformers' Qwen3MoeExperts loop with the W8A8 MoE's two quantized inputs: x before
        gate/up, the intermediate before down."""
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(dequantized(hidden_states[token]),
                                experts.gate_up_proj[expert]).chunk(2, dim=-1)
            act = dequantized(experts.act_fn(gate) * up)
            y = F.linear(act, experts.down_proj[expert]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    if getattr(model, "fake_quantized", False):
        return model
    model.fake_quantized = True
    for name, module in model.named_modules():
        if re.fullmatch(r".*\.(q|k|v|o|gate|up|down)_proj", name):
            module.register_forward_pre_hook(
                hook(row_shards if name.endswith(("o_proj", "down_proj")) else 1))
        if type(module).__name__ == "Qwen3MoeExperts":
            module.forward = types.MethodType(experts_forward, module)
    return model


@pytest.mark.parametrize("tp", [1, 2])
def test_online_fp8_matches_transformers_on_fp8_weights_and_activations(float_ckpt, tmp_path,
                                                                        oracle, tp):
    ckpt = roundtrip_copy(float_ckpt, str(tmp_path / "channel_dq"),
                          lambda w: (lambda q, s: q.float() * s)(*quantize_fp8_per_channel(w)))
    model = fake_quantized_activations(oracle.model(ckpt), tp)
    prompts = random_prompts(8, 3, 40, seed=12)
    def model_check(m):
        layer = m.layers[0].self_attn.o_proj
        assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (64, 1)
    greedy, logprobs = generate_both(float_ckpt, prompts, model_check, quantization="fp8",
                                     tensor_parallel_size=tp)
    assert_w8a8_matches(oracle, ckpt, model, prompts, greedy, logprobs)


def _load(path: str, rank: int = 0, size: int = 1):
    hf = AutoConfig.from_pretrained(path)
    with tensor_parallel(rank, size), quantization(config := get_quantization_config(hf, None)):
        model = get_model_class(hf)(hf)
        skip_unconverted_layers(model, config)
    loader.load_model(model, path)
    return model


def _edit(src: str, dst, edit) -> str:
    import shutil
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    weights = load_file(path)
    edit(weights)
    save_file(weights, path)
    return str(dst)


SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"


def test_a_missing_scale_is_named_with_its_file(fp8_ckpt, tmp_path):
    ckpt = _edit(fp8_ckpt, tmp_path / "bad", lambda w: w.pop(SCALE))
    with pytest.raises(ValueError, match=re.escape(
            "checkpoint tensor 'model.layers.1.mlp.down_proj.weight' in model.safetensors: is "
            f"float8_e4m3fn but the checkpoint has no '{SCALE}'")):
        _load(ckpt)


def test_a_scale_of_the_wrong_shape_is_named_with_its_file(fp8_ckpt, tmp_path):
    ckpt = _edit(fp8_ckpt, tmp_path / "bad", lambda w: w.update({SCALE: torch.ones(3, 4)}))
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor '{SCALE}' in "
                                                   "model.safetensors: has shape "
                                                   "(3, 4) but the model expects (2, 4)")):
        _load(ckpt)


def test_a_part_that_is_not_a_multiple_of_the_block_is_refused(float_ckpt, tmp_path):
    ckpt = quantize_checkpoint(float_ckpt, str(tmp_path / "b128"), 128)  # k_proj: 64 rows
    with pytest.raises(ValueError, match=r"checkpoint tensor "
                                         r"'model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv'"
                                         r" in model\.safetensors: k_proj's rows \(64\) is not a "
                                         r"multiple of the fp8 weight block size 128"):
        _load(ckpt)


def test_a_shard_that_is_not_a_multiple_of_the_block_is_refused(float_ckpt, tmp_path):
    ckpt = quantize_checkpoint(float_ckpt, str(tmp_path / "b64"), 64)
    with pytest.raises(ValueError, match=r"k_proj's rows per rank \(32\) is not a multiple of the "
                                         r"fp8 weight block"):
        _load(ckpt, 0, 2)


def test_a_row_parallel_shard_that_is_not_a_multiple_of_the_block_is_refused(float_ckpt, tmp_path):
    ckpt = quantize_checkpoint(float_ckpt, str(tmp_path / "b128"), 128)
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale_inv' in model\.safetensors: "
                                         r"input features per rank \(64\) is not a multiple of "
                                         r"the fp8 weight block size 128"):
        _load(ckpt, 0, 2)


def test_online_fp8_leaves_moe_experts_unquantized(tmp_path, caplog):
    from tiny_model import build_tiny_model
    src = build_tiny_model(str(tmp_path / "moe"), "qwen3_moe", head_dim=32, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=64)
    outputs, _ = run_engine(src, [[1, 2, 3]], GREEDY, device="cpu", quantization="fp8")
    assert len(outputs[0]["token_ids"]) == N
    assert "the MoE experts stay unquantized" in caplog.text


def test_a_float_tensor_for_an_fp8_layer_is_refused(fp8_ckpt, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    ckpt = _edit(fp8_ckpt, tmp_path / "bad", lambda w: w.update({name: w[name].float()}))
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor '{name}' in "
                                                   "model.safetensors: is torch.float32 but the "
                                                   "model expects torch.float8_e4m3fn")):
        _load(ckpt)


def test_fp8_tensors_without_a_quantization_config_are_refused(fp8_ckpt, tmp_path):
    from conftest import edited_checkpoint
    ckpt = edited_checkpoint(fp8_ckpt, tmp_path / "bad", quantization_config=None)
    with pytest.raises(ValueError,
                       match="is torch.float8_e4m3fn but the model expects torch.float32"):
        LLM(ckpt, **CPU_ENGINE)


@pytest.mark.parametrize("changes, match", [
    (dict(quant_method="awq"), "quant_method='awq' is not supported"),
    (dict(activation_scheme="static"), "activation_scheme='static' is not supported"),
    (dict(fmt="e5m2"), "fmt='e5m2' is not supported"),
    (dict(weight_block_size=None), "without weight_block_size"),
])
def test_unsupported_quantization_configs_are_refused_by_name(fp8_ckpt, tmp_path, changes, match):
    from conftest import edited_checkpoint
    ckpt = edited_checkpoint(fp8_ckpt, tmp_path / "bad",
                             quantization_config=lambda c: {**c, **changes})
    with pytest.raises(ValueError, match=match):
        LLM(ckpt, **CPU_ENGINE)


def test_quantization_values(float_ckpt, fp8_ckpt):
    with pytest.raises(ValueError, match="quantization='int8' is not supported"):
        LLM(float_ckpt, **CPU_ENGINE, quantization="int8")
    # a block-wise checkpoint stays block-wise
    llm = LLM(fp8_ckpt, **CPU_ENGINE, quantization="fp8")
    try:
        assert (llm.model_runner.model.model.layers[0].self_attn.qkv_proj.weight_scale_inv.shape
                == (8, 2))
    finally:
        llm.exit()


def test_modules_to_not_convert_keeps_a_layer_float(float_ckpt, tmp_path):
    from conftest import edited_checkpoint
    src = quantize_checkpoint(float_ckpt, str(tmp_path / "q"), BLOCK)
    ckpt = _edit(src, tmp_path / "skip", lambda w: [
        w.update({n: w[n].float()}) or w.pop(n + "_scale_inv")
        for n in list(w) if "layers.1.mlp" in n and n.endswith("weight")])
    ckpt = edited_checkpoint(ckpt, tmp_path / "skip2", quantization_config=lambda c: {
        **c, "modules_to_not_convert": ["lm_head", "model.layers.1.mlp"]})
    model = _load(ckpt)
    assert model.model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float32
    assert type(model.model.layers[1].mlp.gate_up_proj.quant_method) is LinearMethod
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8


@pytest.mark.parametrize("tp", [1, 2])
def test_block_fp8_experts_match_transformers_on_the_dequantized_weights(tmp_path, oracle, tp):
    from tiny_model import build_tiny_model
    src = build_tiny_model(str(tmp_path / "moe"), "qwen3_moe", head_dim=32, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    ckpt = quantize_checkpoint(src, str(tmp_path / "moe_fp8"), BLOCK)
    block = (BLOCK, BLOCK)
    ref = roundtrip_copy(src, str(tmp_path / "moe_dq"),
                         lambda w: dequantize_fp8_block(*quantize_fp8_block(w, block), block))
    # attention's projections and the experts: W8A8
    model = fake_quantized_activations(oracle.model(ref), group=BLOCK)
    prompts = random_prompts(6, 3, 40, seed=14)
    greedy, logprobs = generate_both(ckpt, prompts, tensor_parallel_size=tp)
    assert_w8a8_matches(oracle, ref, model, prompts, greedy, logprobs)
    experts = _load(ckpt).model.layers[0].mlp.experts
    assert (experts.w13_weight.dtype == FP8
            and experts.w2_weight_scale_inv.shape == (4, 64 // BLOCK, 64 // BLOCK))


def test_an_expert_block_that_straddles_a_shard_is_refused(tmp_path):
    from tiny_model import build_tiny_model
    src = build_tiny_model(str(tmp_path / "moe"), "qwen3_moe", head_dim=32, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=64)
    ckpt = quantize_checkpoint(src, str(tmp_path / "moe_fp8"), 64)
    with pytest.raises(ValueError, match=(
            r"checkpoint tensor 'model\.layers\.0\.mlp\.experts\.0\.\w+_proj\.weight_scale_inv' "
            r"in model\.safetensors: the experts' intermediate size per rank \(32\) is not a "
            r"multiple of the fp8 weight block size 64")):
        _load(ckpt, 0, 2)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors through Triton: its interpreter")
@pytest.mark.parametrize("online", [True, False])
def test_the_fp8_kernel_path_gives_the_reference_path_tokens(float_ckpt, fp8_ckpt, monkeypatch,
                                                             online):
    """The Triton kernels (run here in the interpreter) in place of the reference: the GEMM for
    prefill, the skinny kernel for decode, both quantizing the activations as the reference does.
    Their sums go in another order, so the sampled tokens' logprobs, up to where the two first
    differ, are held to the W8A8 criteria."""
    from nanovllm import kernels
    from nanovllm.kernels import triton_fp8
    # each prefill over 16 rows (the GEMM); the interpreter is slow
    prompts, n = random_prompts(2, 17, 24, seed=13), 6
    path, kw = (float_ckpt, dict(quantization="fp8")) if online else (fp8_ckpt, {})
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    reference, _ = run_engine(path, prompts, params, device="cpu", dtype="float32", **kw)
    calls = []
    monkeypatch.setattr(kernels, "ops_for", lambda x, name, fallback: (
        calls.append(x.size(0)) or triton_fp8) if name == "triton_fp8" else fallback)
    with_kernel, _ = run_engine(path, prompts, params, device="cpu", dtype="float32", **kw)
    # prefill, then decode
    assert calls and max(calls) > triton_fp8.SKINNY_MAX_M and min(calls) <= 2
    diffs = []
    for ref, got in zip(reference, with_kernel, strict=True):
        for a, b, lp_a, lp_b in zip(ref["token_ids"], got["token_ids"], ref["logprobs"],
                                    got["logprobs"]):
            diffs.append(abs(lp_a[a].logprob - lp_b[a].logprob) if a == b else float("nan"))
            if a != b:
                break
    diffs = torch.tensor(diffs)
    assert diffs.numel() >= len(prompts) * n // 2, (
        "the paths parted within the first half of the tokens")
    assert (float((diffs < W8A8_TYPICAL).double().mean()) >= 0.9
            and not diffs.isnan().sum() > 1), diffs


def test_the_quantize_tool_refuses_to_destroy_its_source_or_requantize(float_ckpt, fp8_ckpt,
                                                                       tmp_path):
    """SRC as DST (or inside it) is refused before anything is written; an fp8 source is refused;
    a non-empty destination is refused; the copy appears only once complete."""
    import shutil
    src = str(tmp_path / "src")
    shutil.copytree(float_ckpt, src)
    before = {f: os.path.getsize(os.path.join(src, f)) for f in os.listdir(src)}
    for dst in (src, os.path.join(src, "inside")):
        with pytest.raises(ValueError, match="is the source checkpoint or inside it"):
            quantize_checkpoint(src, dst, BLOCK)
    assert {f: os.path.getsize(os.path.join(src, f)) for f in os.listdir(src)} == before
    with pytest.raises(ValueError, match="is already quantized"):
        quantize_checkpoint(fp8_ckpt, str(tmp_path / "again"), 64)
    assert not os.path.exists(tmp_path / "again")
    os.makedirs(tmp_path / "full")
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        quantize_checkpoint(src, str(tmp_path / "full"), BLOCK)
    assert quantize_checkpoint(src, str(tmp_path / "q"), BLOCK) == str(tmp_path / "q")
    assert not os.path.exists(str(tmp_path / "q") + ".partial")
    with LLM(str(tmp_path / "q"), **CPU_ENGINE) as llm:
        assert "fp8" in llm.features


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_scale_that_is_not_finite_and_positive_is_named_with_its_file(fp8_ckpt, tmp_path, bad):
    """NaN or inf block scales loaded silently: every logprob NaN, every token 0, "length"."""
    def poison(w):
        w[SCALE] = w[SCALE].clone()
        w[SCALE][0, 0] = bad
    ckpt = _edit(fp8_ckpt, tmp_path / "bad", poison)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor '{SCALE}' in "
                                                   "model.safetensors: fp8 block scales must be "
                                                   "finite and > 0, got [")):
        LLM(ckpt, **CPU_ENGINE)
