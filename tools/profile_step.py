"""Where one decode step's time goes: CPU time of schedule, prepare_decode + step_tensors (batch
arrays, their copy to the device), the forward's launch, sampling, postprocess; the GPU time of the
forward; and on CUDA the step's kernels one by one (launches, microseconds, the idle time between
them: ``kernel_table``), and one decoder layer's kernels in order (time, gap before each, bytes a
model says it must move, achieved GB/s: ``layer_table``; ``--markdown`` prints that table for
docs/PERFORMANCE.md instead of the JSON line).

Fills the engine with ``batch`` sequences of about ``context`` tokens, then times ``steps`` decode
steps by wrapping the engine's methods from outside (nothing in the engine is instrumented).

    python tools/profile_step.py [--model qwen3-0.6b|qwen3-8b] [--batch 1 16 64 256]
                                 [--context 1024] [--steps 50] [--kv-cache-dtype auto|fp8]
                                 [--markdown]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from functools import wraps

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine import batch as step_input  # noqa: E402
from nanovllm.engine.outputs import ModelRunnerOutput  # noqa: E402
from nanovllm.models.presets import PRESETS  # noqa: E402


class StepTimer:
    """Wall-clock time per named phase (CPU side; device work is asynchronous), plus CUDA-event
    time of the forward on the GPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.cpu = defaultdict(list)
        self.gpu: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.enabled = False
        self.wrapped: list[tuple[object, str, object]] = []

    def wrap(self, obj, name: str, gpu: bool = False):
        fn = getattr(obj, name)
        self.wrapped.append((obj, name, obj.__dict__.get(name)))

        @wraps(fn)
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            if gpu and self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                start.record()
            t = time.perf_counter()
            result = fn(*args, **kwargs)
            self.cpu[name].append(time.perf_counter() - t)
            if gpu and self.cuda:
                end.record()
                self.gpu.append((start, end))
            return result

        setattr(obj, name, timed)

    def unwrap(self):
        """Puts every wrapped method back (so the next batch's timer does not wrap this one's)."""
        for obj, name, original in reversed(self.wrapped):
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)
        self.wrapped.clear()

    def summary(self) -> dict:
        out = {name: round(1e3 * sum(v) / len(v), 3) for name, v in self.cpu.items()}
        if self.gpu:
            torch.cuda.synchronize()
            out["forward_gpu_ms"] = round(sum(s.elapsed_time(e) for s, e in self.gpu)
                                          / len(self.gpu), 3)
        return out


def profile(llm: LLM, batch: int, context: int, steps: int) -> dict:
    runner, scheduler = llm.model_runner, llm.scheduler
    timer = StepTimer(llm.config.device == "cuda")
    timer.wrap(scheduler, "schedule")
    timer.wrap(step_input, "prepare_decode")
    timer.wrap(runner, "step_tensors")
    timer.wrap(runner.sampling, "prepare_sample")
    timer.wrap(runner, "run_model", gpu=True)
    timer.wrap(runner.sampler, "forward")
    timer.wrap(scheduler, "postprocess")
    timer.wrap(llm.core, "step")
    # with async scheduling: waiting for the previous step's tokens
    timer.wrap(ModelRunnerOutput, "result")
    sp = SamplingParams(temperature=0.6, max_tokens=2 * steps + 4, ignore_eos=True)
    for i in range(batch):
        llm.add_request([(i * 7 + j) % 250 for j in range(context)], sp)
    while (any(seq.num_cached_tokens < seq.num_prompt_tokens for seq in scheduler.waiting)
           or scheduler.waiting):
        llm.core.step()  # prefill everything first
    llm.core.step()
    llm.core.step()
    # the profiled pass's mean K/V length, for the byte model
    model_context = context + 2 + steps + steps // 2
    timer.enabled = True
    start = time.perf_counter()
    for _ in range(steps):
        llm.core.step()
    if timer.cuda:
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    timer.enabled = False
    timer.unwrap()
    busy = gpu_busy_per_step(llm, steps, batch, model_context) if timer.cuda else None
    while llm.has_unfinished_requests():
        llm.step()
    result = dict(batch=batch, context=context, async_scheduling=llm.config.async_scheduling,
                  kv_cache_dtype=llm.config.kv_cache_dtype,
                  step_ms=round(1e3 * wall, 3), **timer.summary())
    # the GPU's idle share of a decode step: waiting for the CPU between kernels and steps
    if busy is not None:
        result["gpu_busy_ms"] = round(busy[0], 3)
        result["gpu_idle_fraction"] = round(1 - busy[0] / busy[1], 3)
        result["kernel_table"] = busy[2]
        result["model_context"], result["layer_table"] = model_context, busy[3]
    result["sampler_ms"] = result.pop("forward", None)
    result["wait_ms"] = result.pop("result", None)
    step_ms = result.pop("step", None)
    result["step_cpu_ms"] = (None if step_ms is None
                             else round(step_ms - (result["wait_ms"] or 0), 3))
    return result


def gpu_busy_per_step(llm: LLM, steps: int, batch: int,
                      context: int) -> tuple[float, float, dict, dict | None]:
    """(ms of GPU kernel and copy time per decode step, ms of wall time per step, ``kernel_table``
    of the device's kernels, ``layer_table`` with the bytes of ``batch`` sequences of ``context``
    tokens) over ``steps`` more steps under torch.profiler (a separate pass: the profiler slows the
    CPU side a little)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            llm.core.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    busy_us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                  for e in prof.key_averages())
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == DeviceType.CUDA]
    hf_config = llm.config.hf_config
    model_bytes = decode_bytes(hf_config, batch, context, llm.config.torch_dtype.itemsize,
                               llm.config.kv_cache_torch_dtype.itemsize)
    return (busy_us / 1e3 / steps, 1e3 * wall / steps, kernel_table(kernels, steps),
            layer_table(kernels, hf_config.num_hidden_layers, model_bytes))


def kernel_table(kernels: list[tuple[str, float, float]], steps: int, top: int = 25) -> dict:
    """Per decode step, from the device's activity (name, start us, end us) over ``steps`` steps:
    the launches and microseconds of each name (the ``top`` longest), how many launches in all, the
    time some kernel was running (overlaps counted once), and the idle time between one kernel's end
    and the next one's start (inside a step and between steps)."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    busy = idle = 0.0
    end = None
    for name, start, stop in sorted(kernels, key=lambda k: k[1]):
        per_name[name][0] += 1
        per_name[name][1] += stop - start
        if end is None or start >= end:
            idle += 0.0 if end is None else start - end
            busy += stop - start
        elif stop > end:
            busy += stop - end
        end = stop if end is None else max(end, stop)
    rows = sorted(per_name.items(), key=lambda item: -item[1][1])[:top]
    return dict(launches_per_step=round(len(kernels) / steps, 2),
                busy_us_per_step=round(busy / steps, 2), idle_us_per_step=round(idle / steps, 2),
                kernels=[dict(name=name[:90], launches_per_step=round(count / steps, 2),
                              us_per_step=round(total / steps, 2))
                         for name, (count, total) in rows])


GEMM_WORDS = ("gemm", "nvjet", "cutlass", "sm90", "xmma", "cublas", "splitk", "linear", "skinny")
GEMM_ROLES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# by GEMMs before
NORM_ROLES = ("input_layernorm", "qk_norm", "post_attention_layernorm", "norm", "input_layernorm")


def kernel_kind(name: str) -> str:
    """What a kernel does, from its name alone ("gemm" and "norm" get their layer role from
    ``layer_roles``). Attention names win over GEMM words: FlashAttention's
    ``flash_fwd_splitkv_kernel`` holds "splitk", its Hopper kernels cutlass and sm90 templates."""
    n = name.lower()
    if "qk_norm_rope" in n:
        return "qk_norm_rope_store"
    attention = any(w in n for w in ("attn", "attention", "flash", "decode"))
    if "merge" in n or attention and "combine" in n:
        return "attention_merge"
    if attention:
        return "attention"
    if any(w in n for w in GEMM_WORDS):
        return "gemm"
    if any(w in n for w in ("rms", "rsqrt", "norm")):
        return "norm"
    return "silu_and_mul" if "silu" in n else "other"


def layer_roles(names: list[str]) -> list[str]:
    """The role of each kernel of one decoder layer, by name and order: the k-th GEMM-like kernel is
    the k-th projection (a norm fused into a GEMM leaves the GEMM's role, and no norm kernel), a
    norm before the first GEMM is the input norm, one after the qkv GEMM a q/k norm, one after the o
    GEMM the post-attention norm."""
    roles, gemms = [], 0
    for kind in map(kernel_kind, names):
        if kind == "gemm":
            kind = GEMM_ROLES[gemms] if gemms < len(GEMM_ROLES) else "gemm"
            gemms += 1
        elif kind == "norm":
            kind = NORM_ROLES[min(gemms, 4)]
        roles.append(kind)
    return roles


def find_layer_block(names: list[str], num_layers: int,
                     max_period: int = 48) -> tuple[int, int] | None:
    """(start, period) of the first run of ``num_layers`` identical blocks of kernel names in the
    first half of the trace: each step runs one decoder layer's kernels once per layer, in a row."""
    for start in range(len(names) // 2):
        for p in range(1, max_period + 1):
            end = start + p * num_layers
            if (end <= len(names) and names[start] == names[start + p]
                    and names[start + p:end] == names[start:end - p]):
                return start, p
    return None


def layer_table(kernels: list[tuple[str, float, float]], num_layers: int,
                model_bytes: dict[str, int]) -> dict | None:
    """One decoder layer's kernels in order, from the device's activity (name, start us, end us)
    over many decode steps: every occurrence of the repeating block (``find_layer_block``), rotated
    to start at the layer's input norm (or first GEMM). Per position: role, microseconds per launch,
    idle microseconds before it (start minus the previous kernel's end, at least 0), the bytes
    ``model_bytes`` gives its role (none for a role the model lacks) and the GB/s those make in that
    time; per layer and over all layers of a step: launches, us, gap us, with the layer's GB/s from
    every role's bytes (a role fused into another kernel counts there). None where no block repeats
    (no CUDA kernels)."""
    kernels = sorted(kernels, key=lambda k: k[1])
    names = [k[0] for k in kernels]
    found = find_layer_block(names, num_layers)
    if found is None:
        return None
    start, p = found
    block = names[start:start + p]
    first = next((j for j, name in enumerate(block) if kernel_kind(name) == "gemm"), 0)
    if kernel_kind(block[first - 1]) == "norm":
        first -= 1
    order = [(first + j) % p for j in range(p)]
    occurrences, i = [], 0
    while i + p <= len(names):
        if names[i:i + p] == block:
            occurrences.append(i)
            i += p
        else:
            i += 1
    gaps = [0.0] + [max(0.0, k[1] - prev[2]) for prev, k in zip(kernels, kernels[1:])]
    rows = []
    for position, (j, role) in enumerate(zip(order, layer_roles([block[j] for j in order]))):
        us = sum(kernels[i + j][2] - kernels[i + j][1] for i in occurrences) / len(occurrences)
        nbytes = model_bytes.get(role)
        rows.append(dict(position=position, role=role, name=block[j][:70], us=us,
                         gap_us=sum(gaps[i + j] for i in occurrences) / len(occurrences),
                         bytes=nbytes,
                         gb_per_s=(None if nbytes is None or us <= 0
                                   else round(nbytes / us / 1e3, 1))))
    us, gap, nbytes = (sum(r["us"] for r in rows), sum(r["gap_us"] for r in rows),
                       sum(model_bytes.values()))
    for row in rows:
        row["us"], row["gap_us"] = round(row["us"], 2), round(row["gap_us"], 2)
    return dict(period=p, start=start, occurrences=len(occurrences), kernels=rows,
                layer=dict(launches=p, us=round(us, 2), gap_us=round(gap, 2), bytes=nbytes,
                           gb_per_s=round(nbytes / us / 1e3, 1) if us > 0 else None),
                all_layers=dict(launches=p * num_layers, us=round(us * num_layers, 2),
                                gap_us=round(gap * num_layers, 2)))


def decode_bytes(hf_config, batch: int, context: int, dtype_bytes: int = 2,
                 kv_bytes: int | None = None) -> dict[str, int]:
    """Bytes per decode step that each kernel of one Llama/Qwen3 decoder layer must at least move (a
    model, not a measurement: weights and activations read once, outputs written once, no re-reads,
    caches or norm weights) for ``batch`` sequences (M) of ``context`` tokens of K/V, b bytes an
    element (kv_bytes in the KV cache, b by default: the store writes them, attention reads them).
    H hidden, q = heads x head_dim, kv = K/V heads x head_dim, I intermediate:
    norm with residual add: x and residual in, out and residual out, 4MHb;
    qkv_proj: weights H(q+2kv)b, MHb in, M(q+2kv)b out;
    qk_norm_rope_store: M(q+2kv)b in, Mqb + 2Mkvb out;
    attention: the context's K and V 2M context kv b, q in and out 2Mqb; o_proj: qHb + Mqb + MHb;
    gate_up_proj: 2HIb + MHb + 2MIb; silu_and_mul: 2MIb in, MIb out; down_proj: IHb + MIb + MHb."""
    c, m, b = hf_config, batch, dtype_bytes
    kb = b if kv_bytes is None else kv_bytes
    h, i = c.hidden_size, c.intermediate_size
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    return dict(input_layernorm=4 * m * h * b,
                qkv_proj=(h * (q + 2 * kv) + m * h + m * (q + 2 * kv)) * b,
                qk_norm_rope_store=m * (q + 2 * kv) * b + m * q * b + 2 * m * kv * kb,
                attention=2 * m * context * kv * kb + 2 * m * q * b,
                o_proj=(q * h + m * q + m * h) * b,
                post_attention_layernorm=4 * m * h * b,
                gate_up_proj=(2 * h * i + m * h + 2 * m * i) * b,
                silu_and_mul=3 * m * i * b,
                down_proj=(i * h + m * i + m * h) * b)


def markdown(result: dict) -> str:
    """``profile``'s layer table as a Markdown table (for docs/PERFORMANCE.md)."""
    table, head = result.get("layer_table"), f"Batch {result['batch']}, context {result['context']}"
    if not table:
        return f"{head}: no repeating decoder-layer block of kernels found.\n"

    def size(n):
        return "" if n is None else f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"

    layer, steps = table["layer"], table["all_layers"]
    lines = [f"{head} (bytes at {result['model_context']} tokens of K/V): one decoder layer is "
             f"{layer['launches']} kernels, {layer['us']} us and {layer['gap_us']} us of gaps; "
             f"all layers {steps['us']} us and {steps['gap_us']} us of gaps a step.", "",
             "| # | role | kernel | us | gap us | bytes | GB/s |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in table["kernels"] + [dict(position="", role="layer", name="", **layer)]:
        name = f"`{r['name']}`".replace("|", "\\|") if r["name"] else ""
        lines.append(f"| {r['position']} | {r['role']} | {name} | {r['us']} | {r['gap_us']} "
                     f"| {size(r['bytes'])} | {'' if r['gb_per_s'] is None else r['gb_per_s']} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b",
                        help=f"a checkpoint or a preset: {', '.join(PRESETS)}")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    parser.add_argument("--markdown", action="store_true",
                        help="print the layer table in Markdown, not the JSON")
    args = parser.parse_args()
    dummy = args.model in PRESETS
    llm = LLM(args.model, load_format="dummy" if dummy else "auto", skip_tokenizer_init=dummy,
              enforce_eager=args.enforce_eager, max_model_len=args.context + 2 * args.steps + 16,
              async_scheduling=False if args.no_async_scheduling else None,
              kv_cache_dtype=args.kv_cache_dtype)
    for batch in args.batch:
        result = profile(llm, batch, args.context, args.steps)
        print(markdown(result) if args.markdown else json.dumps(result), flush=True)
    llm.exit()


if __name__ == "__main__":
    main()
