"""The persistent decode kernel against the CUDA-graph decode of the model, one decode step of the layers (without
the LM head and sampler), on random weights of a preset's shapes; and where the kernel's time goes, stage by stage,
from the programs' own timestamps (``%globaltimer``).

    python tools/bench_persistent.py [--model qwen3-0.6b] [--batch 1 4 16] [--context 1024] [--quantization fp8]
                                     [--json]

fp8 weights: a ``-fp8`` preset (``qwen3-8b-fp8``: block-wise, 128 x 128, as Qwen3-*-FP8) or ``--quantization fp8``
(per channel, the activations quantized per token); both sides read them, the graph through ``triton_fp8``.

Each line: the model's graph and the kernel under each tuning (L2 prefetch, the barrier's poll, programs per SM)
in µs a step, and the layers' weight bytes over that time; then for the default tuning each stage's median task
time and barrier wait over programs and layers, and the stage's weight bandwidth (its bytes over the span from the
first program's start to the last program's end of tasks).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm.kernels.decode_plan import STAGES  # noqa: E402
from nanovllm.layers.attention import Attention, bind_backend  # noqa: E402
from nanovllm.layers.quantization import get_quantization_config, quantization  # noqa: E402
from nanovllm.models import get_model_class  # noqa: E402
from nanovllm.models.persistent import PersistentDecoder  # noqa: E402
from nanovllm.models.presets import preset_config  # noqa: E402
from nanovllm.utils.context import set_context  # noqa: E402
from nanovllm.utils.loader import load_dummy_weights  # noqa: E402

BLOCK = 16
# (programs per SM, L2 prefetch, the barrier polls with ld.acquire, fp8 weights' K columns a load (0: the plan's,
# a product per scale block; 128: one block's, one product)): the first is the default, the safe one
VARIANTS = [(2, True, False, 0), (2, False, False, 0), (2, True, True, 0), (2, True, False, 128)]


def build(preset: str, num_blocks: int, quantize: str | None = None):
    config = preset_config(preset)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"), quantization(get_quantization_config(config, quantize)):
        model = get_model_class(config)(config, max_model_len=8192)
    torch.set_default_dtype(torch.float32)
    load_dummy_weights(model)
    attn = model.model.layers[0].self_attn
    kv = torch.randn(2, config.num_hidden_layers, num_blocks, BLOCK, attn.num_kv_heads, attn.head_dim,
                     device="cuda", dtype=torch.bfloat16)
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, Attention)):
        layer.backend = bind_backend("triton")
        layer.k_cache, layer.v_cache = kv[0, i], kv[1, i]
    return model, kv


def layer_bytes(model) -> dict[str, int]:
    """Weight bytes (fp8 scales included) a step reads in each stage, over all layers."""
    total = dict.fromkeys(STAGES, 0)
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for stage, linear in (("qkv", a.qkv_proj), ("o_proj", a.o_proj), ("gate_up", m.gate_up_proj),
                              ("down_proj", m.down_proj)):
            for name in ("weight", "weight_scale_inv", "weight_scale"):
                if (p := getattr(linear, name, None)) is not None:
                    total[stage] += p.numel() * p.element_size()
    return total


def step_inputs(batch: int, context: int):
    blocks = (context + BLOCK - 1) // BLOCK
    tables = torch.arange(batch * blocks, dtype=torch.int32, device="cuda").view(batch, blocks)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    positions = (ctx - 1).long()
    slots = (tables[:, -1] * BLOCK + (context - 1) % BLOCK).int()
    return torch.randint(0, 1000, (batch,), device="cuda"), positions, slots, ctx, tables


def time_graph(fn, reps: int = 100) -> float:
    """Median µs of one replay of fn captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def stage_breakdown(runner: PersistentDecoder, inputs, num_layers: int, stage_bytes: dict) -> dict:
    trace = torch.zeros(runner.plan.num_programs, num_layers, len(STAGES), 3, dtype=torch.int64, device="cuda")
    runner.options = dict(runner.options, trace=trace)
    for _ in range(3):
        runner(*inputs)
    torch.cuda.synchronize()
    runner.options.pop("trace")
    t = trace.double()
    out = {}
    for s, stage in enumerate(STAGES):
        tasks, wait = t[:, :, s, 1] - t[:, :, s, 0], t[:, :, s, 2] - t[:, :, s, 1]
        span = (t[:, :, s, 1].amax(0) - t[:, :, s, 0].amin(0))  # per layer, ns
        valid = slice(0, num_layers - (1 if s == len(STAGES) - 1 else 0))
        out[stage] = dict(task_us=round(float(tasks.median()) / 1e3, 2),
                          wait_us=round(float(wait[:, valid].median()) / 1e3, 2),
                          span_us=round(float(span.median()) / 1e3, 2),
                          tb_s=round(stage_bytes[stage] / num_layers / float(span.median()) / 1e3, 2)
                          if stage_bytes[stage] else None)
    layer_ns = (t[:, 1:, 0, 0].amin(0) - t[:, :-1, 0, 0].amin(0))
    out["layer_us"] = round(float(layer_ns.median()) / 1e3, 2)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="quantize the weights at load (per channel), as LLM(quantization='fp8')")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    blocks = (args.context + BLOCK - 1) // BLOCK
    model, kv = build(args.model, max(args.batch) * blocks + 1, args.quantization)
    num_layers = len(model.model.layers)
    stage_bytes = layer_bytes(model)
    weights = sum(stage_bytes.values())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch in args.batch:
        ids, positions, slots, ctx, tables = step_inputs(batch, args.context)
        result = dict(model=args.model, quantization=args.quantization, batch=batch, context=args.context,
                      device=torch.cuda.get_device_name(),
                      date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        with torch.inference_mode(), set_context(False, slot_mapping=slots, context_lens=ctx, block_tables=tables):
            result["graph_us"] = round(time_graph(lambda i=ids, p=positions: model(i, p)), 1)
            per_sm = None
            for programs_per_sm, prefetch, spin_asm, load_k in VARIANTS:
                key = f"kernel_us[{programs_per_sm}/SM,prefetch={int(prefetch)},asm={int(spin_asm)}]"
                runner = PersistentDecoder(model, kv, sms * programs_per_sm, prefetch=prefetch, spin_asm=spin_asm)
                if load_k:
                    if runner.plan.fp8 is None:
                        continue
                    key, runner.options["fp8_load_k"] = f"{key[:-1]},fp8_load_k={load_k}]", load_k
                try:
                    result[key] = round(time_graph(lambda r=runner, i=ids, p=positions: r(i, p)), 1)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                    result[key] = f"{type(e).__name__}: {str(e)[:300]}"
                    continue
                if int(runner.scratch.sync[1]):
                    result[key] = "a barrier timed out"
                if per_sm is None:
                    per_sm = result["resident_programs_per_sm"] = runner.resident_per_sm
                    result["fp8"] = runner.plan.fp8
                    try:
                        result["breakdown"] = stage_breakdown(runner, (ids, positions), num_layers, stage_bytes)
                    except Exception as e:  # noqa: BLE001
                        result["breakdown"] = f"{type(e).__name__}: {str(e)[:300]}"
            best = min((v for k, v in result.items() if k.startswith("kernel_us") and isinstance(v, float)),
                       default=None)
            result["weights_mb"] = round(weights / 1e6, 1)
            result["graph_tb_s"] = round(weights / result["graph_us"] / 1e6, 2)
            result["kernel_best_tb_s"] = best and round(weights / best / 1e6, 2)
        print(json.dumps(result) if args.json else result, flush=True)


if __name__ == "__main__":
    main()
