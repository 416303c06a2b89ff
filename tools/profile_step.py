"""Where one decode step's time goes: CPU time of schedule, build_decode + step_tensors (batch arrays, their
copy to the device), the forward's launch, sampling, postprocess; the GPU time of the forward; and on CUDA
the step's kernels one by one (launches, microseconds, the idle time between them: ``kernel_table``).

Fills the engine with ``batch`` sequences of about ``context`` tokens, then times ``steps`` decode
steps by wrapping the engine's methods from outside (nothing in the engine is instrumented).

    python tools/profile_step.py [--model qwen3-0.6b] [--batch 1 64 256 512] [--context 1024] [--steps 50]
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
from nanovllm.engine.outputs import SampledTokens  # noqa: E402
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
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
            out["forward_gpu_ms"] = round(sum(s.elapsed_time(e) for s, e in self.gpu) / len(self.gpu), 3)
        return out


def profile(llm: LLM, batch: int, context: int, steps: int) -> dict:
    runner, scheduler = llm.model_runner, llm.scheduler
    timer = StepTimer(llm.config.device == "cuda")
    timer.wrap(scheduler, "schedule")
    timer.wrap(step_input, "build_decode")
    timer.wrap(runner, "step_tensors")
    timer.wrap(runner, "prepare_sample")
    timer.wrap(runner, "run_model", gpu=True)
    timer.wrap(runner.sampler, "forward")
    timer.wrap(scheduler, "postprocess")
    timer.wrap(llm.core, "step")
    timer.wrap(SampledTokens, "result")  # with async scheduling: waiting for the previous step's tokens
    sp = SamplingParams(temperature=0.6, max_tokens=2 * steps + 4, ignore_eos=True)
    for i in range(batch):
        llm.add_request([(i * 7 + j) % 250 for j in range(context)], sp)
    while any(seq.num_cached_tokens < seq.num_prompt_tokens for seq in scheduler.waiting) or scheduler.waiting:
        llm.core.step()  # prefill everything first
    llm.core.step()
    llm.core.step()
    timer.enabled = True
    start = time.perf_counter()
    for _ in range(steps):
        llm.core.step()
    if timer.cuda:
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    timer.enabled = False
    timer.unwrap()
    busy = gpu_busy_per_step(llm, steps) if timer.cuda else None
    while not llm.is_finished():
        llm.core.step()
    llm.requests.clear()
    result = dict(batch=batch, context=context, async_scheduling=llm.config.async_scheduling,
                  step_ms=round(1e3 * wall, 3), **timer.summary())
    if busy is not None:  # the GPU's idle share of a decode step: waiting for the CPU between kernels and steps
        result["gpu_busy_ms"] = round(busy[0], 3)
        result["gpu_idle_fraction"] = round(1 - busy[0] / busy[1], 3)
        result["kernel_table"] = busy[2]
    result["sampler_ms"] = result.pop("forward", None)
    result["wait_ms"] = result.pop("result", None)
    step_ms = result.pop("step", None)
    result["step_cpu_ms"] = None if step_ms is None else round(step_ms - (result["wait_ms"] or 0), 3)
    return result


def gpu_busy_per_step(llm: LLM, steps: int) -> tuple[float, float, dict]:
    """(ms of GPU kernel and copy time per decode step, ms of wall time per step, ``kernel_table`` of the
    device's kernels) over ``steps`` more steps under torch.profiler (a separate pass: the profiler slows
    the CPU side a little)."""
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
    return busy_us / 1e3 / steps, 1e3 * wall / steps, kernel_table(kernels, steps)


def kernel_table(kernels: list[tuple[str, float, float]], steps: int, top: int = 25) -> dict:
    """Per decode step, from the device's activity (name, start us, end us) over ``steps`` steps: the
    launches and microseconds of each name (the ``top`` longest), how many launches in all, the time some
    kernel was running (overlaps counted once), and the idle time between one kernel's end and the next
    one's start (inside a step and between steps)."""
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
    return dict(launches_per_step=round(len(kernels) / steps, 2), busy_us_per_step=round(busy / steps, 2),
                idle_us_per_step=round(idle / steps, 2),
                kernels=[dict(name=name[:90], launches_per_step=round(count / steps, 2),
                              us_per_step=round(total / steps, 2)) for name, (count, total) in rows])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256, 512])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true")
    args = parser.parse_args()
    dummy = args.model in PRESETS
    llm = LLM(args.model, load_format="dummy" if dummy else "auto", skip_tokenizer_init=dummy,
              enforce_eager=args.enforce_eager, max_model_len=args.context + 2 * args.steps + 16,
              async_scheduling=False if args.no_async_scheduling else None)
    for batch in args.batch:
        print(json.dumps(profile(llm, batch, args.context, args.steps)), flush=True)
    llm.exit()


if __name__ == "__main__":
    main()
