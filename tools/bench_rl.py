"""What an RL loop pays the rollout engine, one JSON line per measurement:

- ``update_weights``: seconds to push every weight from tensors already on the engine's device
  (rank 0's), in transformers' names, as a trainer's ``named_parameters()`` gives them (best of
  ``--repeats``; bar 0.5 s);
- ``sleep``: the fraction of the device memory the engine held (``torch.cuda.mem_get_info`` before
  the engine and after it started, every rank's device) that ``sleep(level=1)`` gives back
  (bar 90%), and its seconds;
- ``logprob_gap`` (with ``--logprob-gap``): while the engine sleeps, transformers recomputes the
  engine's sampled tokens' logprobs (temperature 1) on the same weights, in the model's dtype and in
  float32: the largest and mean absolute gaps (random weights: a near-uniform distribution, so small
  gaps say little about trained ones);
- ``wake_up``: seconds of ``wake_up()`` (weights back from pinned host memory, KV cache zeroed, CUDA
  graphs captured again) and of the first ``generate`` after it (bar 3 s for both);
- ``rl_cycle``: ``sleep(level=2)``, ``wake_up(["weights"])``, ``update_weights``,
  ``wake_up(["kv_cache"])`` and a generate, the seconds of each.

CUDA by default, on a preset with random weights (``load_format="dummy"``);
``--device cpu --model nanovllm:demo`` (or a checkpoint directory) runs the same steps on CPU as a
smoke test (memory fractions are then not measured).

    python tools/bench_rl.py [--model qwen3-8b] [--tp 1] [--logprob-gap] [--out results.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.models.presets import PRESETS, preset_config  # noqa: E402


def emit(out, record: dict):
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def used_bytes(device: str, tp: int) -> int:
    """Device memory in use on the engine's devices (every process's), 0 on CPU."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    return sum(total - free for free, total in (torch.cuda.mem_get_info(i) for i in range(tp)))


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def hf_config_of(model: str):
    if model in PRESETS:
        return preset_config(model)
    from transformers import AutoConfig

    from nanovllm.demo import BUILTIN_MODELS, builtin_model_path
    return AutoConfig.from_pretrained(builtin_model_path(model) if model in BUILTIN_MODELS
                                      else model)


def source_weights(hf_config, device: str, dtype: torch.dtype,
                   seed: int) -> list[tuple[str, torch.Tensor]]:
    """A trainer's weights in transformers' names: N(0, 0.02), norms 1, on ``device``."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    generator = torch.Generator(device).manual_seed(seed)
    weights = []
    for name, param in shapes.named_parameters():
        tensor = torch.empty(param.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
        weights.append((name, tensor))
    return weights


def recompute_logprobs(hf_config, weights, device: str, dtype: torch.dtype, outputs) -> dict:
    """Transformers' logprobs of the sampled tokens on ``weights``, in ``dtype`` and float32: the
    gaps."""
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    model.load_state_dict(dict(weights), strict=False)  # a tied model's lm_head is its embedding
    gaps = {}
    for label in (str(dtype).removeprefix("torch."), "float32"):
        if label == "float32":
            model.float()
        diffs = []
        for output in outputs:
            for completion in output.outputs:
                prompt, ids = list(output.prompt_token_ids), list(completion.token_ids)
                with torch.no_grad():
                    logits = model(
                        torch.tensor([prompt + ids], device=device)).logits[0, len(prompt) - 1:-1]
                ref = torch.log_softmax(logits.float(), -1).gather(
                    1, torch.tensor(ids, device=device)[:, None])
                got = torch.tensor([e[t].logprob for e, t in zip(completion.logprobs, ids)],
                                   device=device)
                diffs.append((got - ref[:, 0]).abs())
        diffs = torch.cat(diffs)
        gaps[label] = {"max": float(diffs.max()), "mean": float(diffs.mean()),
                       "tokens": diffs.numel()}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return gaps


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b",
                        help=f"a preset ({', '.join(PRESETS)}), 'nanovllm:demo' or "
                             "a checkpoint directory")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--repeats", type=int, default=3, help="update_weights pushes timed")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="the engine's (the CUDA graphs captured)")
    parser.add_argument("--logprob-gap", action="store_true",
                        help="measure the engine-vs-transformers gap")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch's CPU threads (0: torch's default)")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available (--device cpu runs the smoke test)")
    out = open(args.out, "a") if args.out else None
    device, dummy = args.device, args.model in PRESETS
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf_config = hf_config_of(args.model)
    base = {"model": args.model, "device": device, "tp": args.tp}
    if device == "cuda":
        base["gpu"] = torch.cuda.get_device_name(0)

    # before the engine: it sizes its cache around them
    weights = source_weights(hf_config, device, dtype, seed=1)
    before_engine = used_bytes(device, args.tp)
    start = time.perf_counter()
    llm = LLM(args.model, device=device, tensor_parallel_size=args.tp, enable_sleep_mode=True,
              dtype=dtype, load_format="dummy" if dummy else "auto", skip_tokenizer_init=dummy,
              max_num_seqs=args.max_num_seqs, max_model_len=2048,
              **({} if device == "cuda" else {"cpu_kvcache_space": 0.25}))
    emit(out, {**base, "metric": "startup", "seconds": round(time.perf_counter() - start, 3)})
    prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(64)] for i in range(8)]
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, logprobs=0, seed=0)
    try:
        llm.generate(prompts, params, use_tqdm=False)  # warm

        times = []
        for _ in range(args.repeats):
            sync(device)
            start = time.perf_counter()
            llm.update_weights(weights)
            sync(device)
            times.append(time.perf_counter() - start)
        emit(out, {**base, "metric": "update_weights", "seconds": round(min(times), 4),
                   "all_seconds": [round(t, 4) for t in times], "tensors": len(weights),
                   "gib": round(sum(t.nbytes for _, t in weights) / 2 ** 30, 3),
                   "bar_seconds": 0.5})

        outputs = llm.generate(prompts, params, use_tqdm=False)
        held = used_bytes(device, args.tp) - before_engine
        start = time.perf_counter()
        llm.sleep(level=1)
        seconds = time.perf_counter() - start
        freed = held - (used_bytes(device, args.tp) - before_engine)
        record = {**base, "metric": "sleep", "level": 1, "seconds": round(seconds, 3)}
        if device == "cuda":
            record.update(held_gib=round(held / 2 ** 30, 3), freed_gib=round(freed / 2 ** 30, 3),
                          freed_fraction=round(freed / held, 4), bar_fraction=0.9)
        emit(out, record)

        if args.logprob_gap:  # the trainer's turn: it has the memory the engine gave back
            gaps = recompute_logprobs(hf_config, weights, device, dtype, outputs)
            emit(out, {**base, "metric": "logprob_gap",
                       "engine_dtype": str(dtype).removeprefix("torch."), **gaps})

        start = time.perf_counter()
        llm.wake_up()
        sync(device)
        woken = time.perf_counter() - start
        after = llm.generate(prompts, params, use_tqdm=False)
        first = time.perf_counter() - start - woken
        same = [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in outputs]
        emit(out, {**base, "metric": "wake_up", "wake_up_seconds": round(woken, 3),
                   "first_generate_seconds": round(first, 3), "seconds": round(woken + first, 3),
                   "same_outputs_as_before_sleep": same, "bar_seconds": 3.0,
                   "rank0_phases": {k: round(v, 3) for k, v
                                    in llm.model_runner.extensions["sleep"].timings.items()}})

        steps, start = {}, time.perf_counter()
        for name, step in (("sleep_level_2", lambda: llm.sleep(level=2)),
                           ("wake_up_weights", lambda: llm.wake_up(tags=["weights"])),
                           ("update_weights", lambda: llm.update_weights(weights)),
                           ("wake_up_kv_cache", lambda: llm.wake_up(tags=["kv_cache"])),
                           ("generate", lambda: llm.generate(prompts, params, use_tqdm=False))):
            t = time.perf_counter()
            step()
            sync(device)
            steps[name] = round(time.perf_counter() - t, 3)
        emit(out, {**base, "metric": "rl_cycle", "seconds": round(time.perf_counter() - start, 3),
                   **steps})
    finally:
        llm.exit()
        if out is not None:
            out.close()


if __name__ == "__main__":
    main()
