"""Where the seconds of ``LLM(...)`` go: each phase of construction timed in a fresh process, first
with empty compiler caches (cold: Triton and Inductor compile everything), then again with the caches
the first process left (warm: what a second run on the same machine pays).

Phases: importing torch and nanovllm, building the model, loading weights,
binding the attention backend, the warmup forward, the KV cache, capturing the decode CUDA graphs,
and the rest of the engine. Each is wall time with the device synchronized at its end.

    python tools/startup_time.py [--model qwen3-0.6b] [--runs cold warm]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(model: str) -> dict:
    """Runs in the timed process: wraps the construction phases from outside, builds the LLM once."""
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    import torch
    phases["import_torch"] = time.perf_counter() - t0
    t = time.perf_counter()
    sys.path.insert(0, ROOT)
    import nanovllm
    from nanovllm.engine import model_runner
    from nanovllm.models.presets import PRESETS
    phases["import_nanovllm"] = time.perf_counter() - t

    def timed(owner, name: str, label: str):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(model_runner, "load_dummy_weights", "load_weights")
    timed(model_runner, "load_model", "load_weights")
    timed(model_runner, "bind_backend", "bind_attention_backend")
    timed(model_runner.ModelRunner, "warmup_model", "warmup_forward")
    timed(model_runner.ModelRunner, "allocate_kv_cache", "kv_cache")
    timed(model_runner, "DecodeGraphs", "cuda_graph_capture")
    timed(model_runner.ModelRunner, "_load_and_prepare", "model_runner_total")
    dummy = model in PRESETS
    t = time.perf_counter()
    llm = nanovllm.LLM(model, load_format="dummy" if dummy else "auto", skip_tokenizer_init=dummy)
    phases["llm_construction"] = time.perf_counter() - t
    llm.exit()
    inner = ("load_weights", "bind_attention_backend", "warmup_forward", "kv_cache", "cuda_graph_capture")
    phases["model_build_and_rest_of_runner"] = phases.pop("model_runner_total") - sum(phases.get(k, 0) for k in inner)
    phases["engine_rest"] = phases["llm_construction"] - phases["model_build_and_rest_of_runner"] - sum(
        phases.get(k, 0) for k in inner)
    return {k: round(v, 3) for k, v in phases.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--runs", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model)))
        return
    with tempfile.TemporaryDirectory() as caches:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(caches, "triton"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"))
        for run in args.runs:  # "warm" after "cold" reuses the caches the cold process filled
            start = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model], env=env,
                                 capture_output=True, text=True, check=False)
            wall = time.perf_counter() - start
            if out.returncode != 0:
                print(json.dumps(dict(run=run, error=out.stderr[-2000:])), flush=True)
                continue
            phases = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(dict(run=run, model=args.model, process_wall_s=round(wall, 3),
                                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **phases)), flush=True)


if __name__ == "__main__":
    main()
