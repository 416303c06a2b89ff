"""The persistent decode kernel: its schedule's protocol run by Python threads as the programs, and the kernel against
the model's own decode forward (PyTorch's kernels) on small random models, in the model's dtype and with fp8 weights
(block-wise, and per channel with the activations quantized per token): on CPU in Triton's interpreter, one launch
per stage over several programs and one whole launch of one program; on the GPU compiled, at real shapes too."""
from __future__ import annotations

import os
import random
import sys
import threading

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from nanovllm.kernels.decode_plan import BLOCK_M, STAGES, DecodePlan
from nanovllm.layers.attention import Attention, bind_backend
from nanovllm.layers.quantization import Fp8Config, quantization, quantize_fp8_block, quantize_fp8_per_channel
from nanovllm.models import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, get_model_class
from nanovllm.models.persistent import PersistentDecoder, unsupported
from nanovllm.models.presets import preset_config
from nanovllm.utils.context import set_context
from nanovllm.utils.loader import load_dummy_weights

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def run_protocol(plan: DecodePlan, batch: int, num_layers: int) -> list[tuple]:
    """The kernel's protocol with threads as its programs: each runs ``tasks_of`` its stages, a task with splits
    arrives at its merge counter, and the program then arrives at the barrier and waits for ``barrier_target``.
    Returns the log of (layer, stage, task, merged) and asserts the ordering the kernel relies on."""
    lock, arrived = threading.Lock(), threading.Condition()
    state = dict(barrier=0, counters={}, done=set(), log=[])

    def program(pid: int):
        for layer in range(num_layers):
            for s, stage in enumerate(STAGES):
                before = STAGES[s - 1] if s else STAGES[-1]
                prev_layer = layer if s else layer - 1
                with lock:  # every task of the stage before has ended
                    if prev_layer >= 0:
                        assert all((prev_layer, before, t) in state["done"]
                                   for t in range(plan.num_tasks(before, batch)))
                splits = plan.splits(stage, batch)
                for t in plan.tasks_of(pid, stage, batch):
                    with lock:
                        key = (layer, stage, t // splits)
                        state["counters"][key] = state["counters"].get(key, 0) + 1
                        merged = state["counters"][key] == splits
                        state["done"].add((layer, stage, t))
                        state["log"].append((layer, stage, t, merged))
                if layer == num_layers - 1 and s == len(STAGES) - 1:
                    return  # the launch's end is the last barrier
                target = plan.barrier_target(layer, s)
                with arrived:
                    state["barrier"] += 1
                    arrived.notify_all()
                    assert arrived.wait_for(lambda t=target: state["barrier"] >= t, timeout=30)

    threads = [threading.Thread(target=program, args=(p,)) for p in range(plan.num_programs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return state["log"]


@pytest.mark.parametrize("programs,batch", [(1, 1), (3, 2), (7, 16), (20, 5)])
def test_schedule_protocol_runs_every_task_once_and_merges_each_split_group_once(programs, batch):
    plan = DecodePlan.build(64, 4, 2, 16, 96, programs)
    log = run_protocol(plan, batch, num_layers=3)
    for layer in range(3):
        for stage in STAGES:
            tasks = sorted(t for lay, s, t, _ in log if lay == layer and s == stage)
            assert tasks == list(range(plan.num_tasks(stage, batch)))
            merges = sorted(t // plan.splits(stage, batch) for lay, s, t, merged in log
                            if lay == layer and s == stage and merged)
            assert merges == list(range(plan.num_tasks(stage, batch) // plan.splits(stage, batch)))


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "llama-3.2-1b"])
def test_plan_of_real_shapes_keeps_every_program_busy(preset):
    c = preset_config(preset)
    plan = DecodePlan.build(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                            getattr(c, "head_dim", c.hidden_size // c.num_attention_heads), c.intermediate_size, 132)
    for stage in STAGES:
        for batch in (1, 4, BLOCK_M):
            assert plan.num_tasks(stage, batch) >= (64 if stage != "attention" else 8 * batch)
    assert plan.attention_splits(1) * c.num_key_value_heads <= 132
    assert plan.hidden_size % plan.block_k("qkv") == 0
    assert (c.num_attention_heads * plan.head_dim) % (plan.o_splits * plan.block_k("o_proj")) == 0
    assert c.intermediate_size % (plan.down_splits * plan.block_k("down_proj")) == 0


def test_plan_refuses_shapes_off_the_tiles():
    with pytest.raises(ValueError, match="hidden_size 72"):
        DecodePlan.build(72, 4, 2, 16, 96, 4)


MODELS = {  # name: (class, config)
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
                                            vocab_size=128, rms_norm_eps=1e-6, max_position_embeddings=512)),
    "qwen2_bias": (Qwen2ForCausalLM, Qwen2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                                 head_dim=64, num_key_value_heads=1, num_hidden_layers=2,
                                                 vocab_size=128, max_position_embeddings=512)),
    "llama_window": (LlamaForCausalLM, LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                                   num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
                                                   vocab_size=128, max_position_embeddings=512, sliding_window=40,
                                                   rope_theta=500000.0)),
}


def fp8_config(fp8: str | None, block: tuple[int, int] | None = None) -> Fp8Config | None:
    """The quantization of a checkpoint's block-wise fp8 weights ("block"), or of ``quantization="fp8"``."""
    return {None: None, "block": Fp8Config(True, block), "channel": Fp8Config()}[fp8]


def quantize_projections(model, seed: int):
    """Each fp8 projection's weight: random, each row and column times its own factor (e^N(0, 0.5): neighbouring
    blocks' and channels' scales differ, so a scale read for the wrong block shows), quantized by its method."""
    generator = torch.Generator().manual_seed(seed)
    factor = lambda n: torch.exp(0.5 * torch.randn(n, generator=generator))  # noqa: E731
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        n, k = module.weight.shape
        w = torch.randn(n, k, generator=generator) * 0.1 * factor(n)[:, None] * factor(k)[None, :]
        if method.quant_config.is_checkpoint_fp8_serialized:
            q, scale = quantize_fp8_block(w, method.block)
            module.weight_scale_inv.copy_(scale)
        else:
            q, scale = quantize_fp8_per_channel(w)
            module.weight_scale.copy_(scale)
        module.weight.copy_(q)


def build(name: str, dtype: torch.dtype, block_size: int = 16, num_blocks: int = 48, seed: int = 0, config=None,
          backend: str = "torch", fp8: str | None = None, fp8_block: tuple[int, int] | None = None):
    cls, config = MODELS[name] if config is None else (get_model_class(config), config)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEVICE), quantization(fp8_config(fp8, fp8_block)):
            model = cls(config, max_model_len=4096)
    finally:
        torch.set_default_dtype(previous)
    load_dummy_weights(model, seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif p.dtype != torch.float8_e4m3fn and not pname.endswith("weight_scale_inv"):
                p.mul_(5.0)  # activations of order one: a wrong term shows
        if fp8:
            quantize_projections(model, seed)
    head_dim = model.model.layers[0].self_attn.head_dim
    kv_heads = model.model.layers[0].self_attn.num_kv_heads
    kv = torch.randn(2, config.num_hidden_layers, num_blocks, block_size, kv_heads, head_dim, device=DEVICE)
    kv = kv.to(dtype)
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, Attention)):
        layer.backend = bind_backend(backend)
        layer.k_cache, layer.v_cache = kv[0, i], kv[1, i]
    return model, kv


def decode_inputs(context_lens: list[int], block_size: int, num_blocks: int, seed: int):
    """Positions, slots, context lengths and block tables of a decode step, each sequence on shuffled blocks."""
    rng = random.Random(seed)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    width = max((n + block_size - 1) // block_size for n in context_lens)
    tables, slots = [], []
    for n in context_lens:
        own = [blocks.pop() for _ in range((n + block_size - 1) // block_size)]
        tables.append(own + [-1] * (width - len(own)))
        slots.append(own[(n - 1) // block_size] * block_size + (n - 1) % block_size)
    as_tensor = lambda x, dtype: torch.tensor(x, dtype=dtype, device=DEVICE)  # noqa: E731
    return (as_tensor([n - 1 for n in context_lens], torch.int64), as_tensor(slots, torch.int32),
            as_tensor(context_lens, torch.int32), as_tensor(tables, torch.int32))


def compare(name: str, dtype: torch.dtype, context_lens: list[int], programs: int, stage_by_stage: bool,
            tol: float, block_size: int = 16, **build_kw):
    model, kv = build(name, dtype, block_size, **build_kw)
    positions, slots, ctx, tables = decode_inputs(context_lens, block_size, kv.size(2), seed=len(context_lens))
    input_ids = torch.randint(0, 128, (len(context_lens),), device=DEVICE)
    kv_kernel = kv.clone()
    with torch.no_grad(), set_context(False, slot_mapping=slots, context_lens=ctx, block_tables=tables):
        expected = model(input_ids, positions)
        runner = PersistentDecoder(model, kv_kernel, programs)
        if stage_by_stage:  # the split merges run
            assert runner.plan.o_splits > 1 and runner.plan.down_splits > 1
        if stage_by_stage:
            runner.options = dict(stages_one_by_one=True)
        got = runner(input_ids, positions)
    assert int(runner.scratch.sync[1]) == 0  # no barrier timed out
    err = float((got.double() - expected.double()).norm() / expected.double().norm())
    assert err < tol, err
    kv_err = float((kv_kernel.double() - kv.double()).abs().max())
    assert kv_err < 50 * tol, kv_err  # the new K/V written where the reference writes them, nothing else


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 1e-2)])
def test_kernel_stage_by_stage_matches_the_model(name, dtype, tol):
    """Several programs (sequential in the interpreter): every task's output and the split merges."""
    compare(name, dtype, [37, 1, 64, 100], programs=16, stage_by_stage=True, tol=tol)


@pytest.mark.parametrize("name", ["qwen3", "llama_window"])
def test_kernel_in_one_launch_matches_the_model(name):
    """One program over every layer and stage, its barriers and merge counters included."""
    compare(name, torch.float32, [90, 17, 3], programs=1, stage_by_stage=False, tol=1e-4)


@pytest.mark.parametrize("fp8,block,dtype,tol", [
    ("block", (32, 32), torch.float32, 1e-4),  # chunks of one block; the o_proj/down_proj splits cross blocks
    # a block of all of K (qkv, gate_up), and splits of whole blocks. fp32 only, as for "channel": in half precision
    # an ulp between two orders of rounding moves an activation across an e4m3 boundary now and then
    ("block", (16, 64), torch.float32, 1e-4),
    ("channel", None, torch.float32, 1e-4),
])
def test_fp8_kernel_stage_by_stage_matches_the_model(fp8, block, dtype, tol):
    """fp8 weights against the model's fp8 forward (the reference: block-wise dequantized, per channel with the
    activations quantized per token). Per channel in fp32 only: in half precision, quantizing the activations turns
    the kernel's and the reference's rounding differences (~1e-3, the attention's) into whole e4m3 steps."""
    compare("qwen3", dtype, [37, 1, 64, 100], programs=16, stage_by_stage=True, tol=tol, fp8=fp8, fp8_block=block)


@pytest.mark.parametrize("fp8,block", [("block", (32, 64)), ("channel", None)])
def test_fp8_greedy_decode_in_one_launch_gives_the_model_tokens(fp8, block):
    """Decode steps of two sequences, each step's input the argmax of the last step's logits: the kernel's (one
    launch, its barriers and merge counters) and the model's, each on its own KV cache, give the same tokens and
    close logits."""
    model, kv = build("qwen3", torch.float32, fp8=fp8, fp8_block=block)
    caches = {"model": kv, "kernel": kv.clone()}
    runner = PersistentDecoder(model, caches["kernel"], 1)
    assert runner.plan.fp8 == fp8
    if fp8 == "block":
        runner.options = dict(fp8_load_k=64)  # loads of one block (the stage-by-stage test's span several)
    lens, steps = [30, 5], 2
    _, _, _, tables = decode_inputs([n + steps for n in lens], 16, kv.size(2), seed=3)
    tokens = {who: [torch.tensor([3, 77], device=DEVICE)] for who in caches}
    for step in range(steps):
        ctx = [n + step for n in lens]
        slots = [int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(ctx)]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
        logits = {}
        with torch.no_grad(), set_context(False, slot_mapping=as_tensor(slots), context_lens=as_tensor(ctx),
                                          block_tables=tables):
            for who, forward in (("model", model), ("kernel", runner)):
                for i, layer in enumerate(m for m in model.modules() if isinstance(m, Attention)):
                    layer.k_cache, layer.v_cache = caches[who][0, i], caches[who][1, i]
                logits[who] = model.compute_logits(forward(tokens[who][-1], as_tensor(ctx).long() - 1))
                tokens[who].append(logits[who].argmax(-1))
        err = float((logits["kernel"] - logits["model"]).norm() / logits["model"].norm())
        assert err < 1e-4, (step, err)
    assert int(runner.scratch.sync[1]) == 0
    assert torch.equal(torch.stack(tokens["kernel"]), torch.stack(tokens["model"]))


def test_fp8_formats_the_kernel_cannot_read_are_refused_by_name():
    with pytest.raises(ValueError, match=r"weight_block_size \(128, 24\)"):
        DecodePlan.build(64, 4, 2, 16, 96, 4, "block", (128, 24))
    with pytest.raises(ValueError, match="fp8='tensor'"):
        DecodePlan.build(64, 4, 2, 16, 96, 4, "tensor")
    model, kv = build("qwen3", torch.float32, fp8="block", fp8_block=(32, 32))
    reasons = unsupported(model, kv, 1)  # fp8 weights are read; block-wise ones not yet on CUDA
    assert len(reasons) == 1 and reasons[0].startswith("block-wise fp8 weights" if CUDA else "not on CUDA")
    model.model.layers[1].mlp.down_proj.unquantize()  # as modules_to_not_convert leaves it
    with pytest.raises(ValueError, match=r"block \[32, 32\]: layers\.0\.qkv_proj, .*unquantized: "
                                         r"layers\.1\.down_proj"):
        PersistentDecoder(model, kv, 4)


def test_unsupported_names_what_the_kernel_cannot_run():
    model, kv = build("qwen3", torch.float32)
    reasons = unsupported(model, kv.to(torch.float16), 2)
    assert "tensor_parallel_size 2" in reasons and "kv_cache_dtype torch.float16" in reasons
    assert ("not on CUDA" in reasons) == (not CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-0.6b", "llama-3.2-1b", "qwen2.5-7b"])
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_kernel_at_real_shapes_on_the_gpu(preset, batch):
    """bf16, two programs per SM, against the model's forward through the Triton kernels; 4 of the layers."""
    at_real_shapes(preset, batch)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-0.6b", "llama-3.2-1b"])
@pytest.mark.parametrize("batch", [1, pytest.param(16, marks=pytest.mark.xfail(
    strict=True, reason="0.7-1.5% off on the H200 (2026-12-04), not yet understood: the engine refuses it"))])
def test_fp8_kernel_at_real_shapes_on_the_gpu(preset, batch):
    """Block-wise fp8 weights (128 x 128 blocks, Qwen3-*-FP8's), against the model's forward through
    ``triton_fp8``'s skinny kernel; 4 of the layers. In fp32: in bf16 an ulp between the two orders of rounding
    moves an activation across an e4m3 boundary every few dozen elements."""
    at_real_shapes(preset, batch, torch.float32, 1e-3, fp8="block", fp8_block=(128, 128))


def at_real_shapes(preset: str, batch: int, dtype=torch.bfloat16, tol=2e-2, **build_kw):
    config = preset_config(preset)
    config.num_hidden_layers = 4
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:4]
    rng = random.Random(batch)
    lens = [rng.randrange(1, 1500) for _ in range(batch)]
    compare(preset, dtype, lens, programs=2 * torch.cuda.get_device_properties(0).multi_processor_count,
            stage_by_stage=False, tol=tol, num_blocks=sum(n // 16 + 1 for n in lens) + 4, config=config,
            backend="triton", **build_kw)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", [None, "fp8-block", "fp8-channel"])
def test_engine_greedy_outputs_are_the_same_with_and_without_the_kernel(checkpoints, tmp_path, weights):
    """fp32 weights; a block-wise fp8 checkpoint (tools/quantize_fp8.py, 64 x 64 blocks); quantization="fp8"."""
    from nanovllm import LLM, SamplingParams
    path, kw = checkpoints["gqa4_hd128_sharded"], {}
    if weights == "fp8-block":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
        from quantize_fp8 import quantize_checkpoint
        path = quantize_checkpoint(path, str(tmp_path / "fp8"), 64)
    elif weights == "fp8-channel":
        kw = dict(quantization="fp8")
    prompts = [[1, 2, 3, 4, 5], [7] * 40, list(range(3, 90))]
    outputs = []
    for max_batch in (16, 0):
        llm = LLM(path, kvcache_block_size=16, max_model_len=512, device="cuda", dtype="float32",
                  persistent_decode_max_batch=max_batch, num_kvcache_blocks=64, **kw)
        persistent = llm.model_runner.graphs.persistent
        assert (persistent is not None) == (max_batch > 0 and weights != "fp8-block")  # block-wise: refused on CUDA
        if persistent is not None:
            assert persistent.plan.fp8 == (weights and weights.removeprefix("fp8-"))
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=48,
                                                                                               temperature=0))])
        llm.exit()
    assert outputs[0] == outputs[1]
