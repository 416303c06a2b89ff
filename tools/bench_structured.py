"""What structured outputs cost: one batch of JSON-schema requests against the same batch
unconstrained (the same prompts, lengths and temperature), in one process, alternating, ``--reps``
times each; output tokens per second, the ratio, and the host time spent making bitmasks
(``fill_ms_per_call``: on the engine's thread; ``xgrammar_ms_per_call``: the rows' fill alone, on
whichever thread).

    # GPU: Qwen3-0.6B shapes, random weights, 64 requests
    python tools/bench_structured.py
    # bitmask filled, then the sampler launched, in the step
    python tools/bench_structured.py --no-handoff
    # xgrammar's BatchGrammarMatcher threads
    python tools/bench_structured.py --fill-threads 8
    # CPU
    python tools/bench_structured.py --model nanovllm:demo --num-seqs 16 --prompt-len 32
        --output-len 48

A preset has no tokenizer, and structured outputs need one, with a realistic vocabulary (xgrammar's
work per step grows with it): the script trains a byte-level BPE tokenizer (``--vocab-size``,
151,643 by default: Qwen3's) on this Python's own source (the standard library, then site-packages,
up to 96 MB) and writes it with the preset's config.json into ``--work`` (once; seconds). The
model's weights are random (``load_format="dummy"``), so a constrained output wanders inside its
JSON strings until ``max_tokens`` ends most of them ("length"): each run reports its finish reasons
and counts the output tokens it made.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from random import Random

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.features import structured_output  # noqa: E402
from nanovllm.models.presets import PRESETS, preset_config  # noqa: E402

# nested objects, arrays, enums, numbers and free strings: the shape of a typical extraction schema
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "rating": {"type": "number"},
        "genre": {"enum": ["drama", "comedy", "thriller", "documentary"]},
        "cast": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "role": {"type": "string"}, "lead": {"type": "boolean"}},
            "required": ["name", "role", "lead"]}},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "rating", "genre", "cast", "summary"],
}
EOS = "<|endoftext|>"


def source_files(budget: int = 96 * 2 ** 20) -> list[Path]:
    """Python sources of this interpreter, standard library first, up to ``budget`` bytes, in a
    fixed order."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    files, total = [], 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if root == roots[0] and "site-packages" in path.parts:
                continue
            size = path.stat().st_size
            if total + size > budget:
                return files
            files.append(path)
            total += size
    return files


def model_dir(args) -> str:
    """A checkpoint directory for a preset: its config.json and a tokenizer trained here (cached in
    --work)."""
    if args.model not in PRESETS:
        return args.model
    out = Path(args.work) / f"{args.model}-bpe{args.vocab_size}"
    if not (out / "tokenizer.json").is_file():
        from tokenizers import ByteLevelBPETokenizer
        from transformers import PreTrainedTokenizerFast
        files = source_files()
        start = time.perf_counter()
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator((f.read_text(errors="replace") for f in files),
                                vocab_size=args.vocab_size, min_frequency=1, show_progress=False,
                                special_tokens=[EOS])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(out)
        config = preset_config(args.model)
        config.eos_token_id = config.bos_token_id = tokenizer.eos_token_id
        config.save_pretrained(out)
        print(f"tokenizer: {len(tokenizer)} tokens from {len(files)} files "
              f"in {time.perf_counter() - start:.1f} s -> {out}", file=sys.stderr)
    return str(out)


class FillTimer:
    """Wraps the engine's bitmask fills (``grammar_bitmask``, and ``grammar_bitmask_async`` of the
    handoff): calls, rows and the seconds they take on the engine's thread (a threaded fill's own
    time is in ``fill_seconds``)."""

    def __init__(self, manager):
        self.calls = self.rows = 0
        self.manager = manager
        self.seconds = 0.0
        for name in ("grammar_bitmask", "grammar_bitmask_async"):
            setattr(manager, name, self.timed(getattr(manager, name)))

    def timed(self, fill):
        def call(seqs, rows, *args):
            start = time.perf_counter()
            bitmask = fill(seqs, rows, *args)
            self.seconds += time.perf_counter() - start
            if bitmask is not None:
                self.calls += 1
                self.rows += sum(seqs[r].seq_id in self.manager.matchers for r in rows)
            return bitmask
        return call


class PhaseTimer:
    """Host seconds in each phase of the engine's steps (``--phases``), by wrapping the functions
    that do them; nested ones are counted in both. ``wait_and_read_back`` holds the wait for a
    handed-off fill (the host waits for it before it waits for the device); ``bitmask_launch`` is
    the device's wait for it and the copy, launched."""

    def __init__(self, llm):
        from nanovllm.engine import batch
        from nanovllm.engine.outputs import ModelRunnerOutput
        from nanovllm.features import bitmask_handoff
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        engine, runner = llm.core, llm.model_runner
        self.wrap(engine, "step", "step")
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.scheduler, "postprocess", "postprocess")
        self.wrap(runner, "prepare_sample", "prepare_sample")
        self.wrap(bitmask_handoff.BitmaskHandoff, "to_device", "bitmask_launch")
        self.wrap(batch, "prepare_decode", "prepare_decode")
        self.wrap(llm.install("structured_outputs").manager, "accept", "accept")
        self.wrap(runner, "forward", "forward_launch")
        self.wrap(runner, "sample", "sample_launch")
        self.wrap(ModelRunnerOutput, "result", "wait_and_read_back")

    def wrap(self, owner, name: str, phase: str):
        fn = getattr(owner, name)
        self.seconds[phase], self.calls[phase] = 0.0, 0

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
                self.calls[phase] += 1
        setattr(owner, name, timed)

    def reset(self):
        self.seconds, self.calls = dict.fromkeys(self.seconds, 0.0), dict.fromkeys(self.calls, 0)

    def per_step(self) -> dict:
        """Milliseconds a step in each phase, and the steps."""
        steps = max(1, self.calls["step"])
        return {"steps": self.calls["step"],
                **{k: round(1e3 * v / steps, 3) for k, v in self.seconds.items()}}


def run(llm, prompts, params, timer: FillTimer, phases: PhaseTimer | None = None) -> dict:
    timer.calls = timer.rows = 0
    timer.seconds = 0.0
    if phases is not None:
        phases.reset()
    manager = llm.install("structured_outputs").manager
    xgrammar_before = manager.fill_seconds
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    completions = [c for o in outputs for c in o.outputs]
    tokens = sum(len(c.token_ids) for c in completions)
    reasons = {r: sum(c.finish_reason == r for c in completions)
               for r in {c.finish_reason for c in completions}}
    valid = sum(_parses(c.text) for c in completions if c.finish_reason == "stop")
    return {"seconds": round(elapsed, 3), "output_tokens": tokens,
            "tok_per_s": round(tokens / elapsed, 1),
            "finish_reasons": reasons, "stop_outputs_that_parse": valid, "fill_calls": timer.calls,
            "fill_ms_per_call": round(1e3 * timer.seconds / timer.calls, 3)
            if timer.calls else None,
            "fill_us_per_row": round(1e6 * timer.seconds / timer.rows, 1) if timer.rows else None,
            "xgrammar_ms_per_call": round(1e3 * (manager.fill_seconds - xgrammar_before)
                                          / timer.calls, 3)
            if timer.calls else None,
            "fill_share_of_wall": round(timer.seconds / elapsed, 3),
            **({"host_ms_per_step": phases.per_step()} if phases is not None else {})}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b",
                        help="a preset (random weights) or a checkpoint directory")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--reps", type=int, default=2, help="timed runs of each batch, alternating")
    parser.add_argument("--vocab-size", type=int, default=151643,
                        help="the trained tokenizer's (presets)")
    parser.add_argument("--work",
                        default=os.environ.get("BENCH_WORK", "/tmp/nanovllm-bench-structured"))
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="on, also on CPU (where it is off by default)")
    parser.add_argument("--no-handoff", action="store_true",
                        help="fill the bitmask, then launch the sampler, before the step returns "
                             "(no BitmaskHandoff)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--fill-threads", type=int, default=structured_output.FILL_THREADS)
    parser.add_argument("--phases", action="store_true",
                        help="also the host's milliseconds a step in each phase of the engine "
                             "(host_ms_per_step)")
    parser.add_argument("--json", action="store_true", help="one JSON line on stdout")
    args = parser.parse_args()
    structured_output.FILL_THREADS = args.fill_threads

    path = model_dir(args)
    dummy = args.model in PRESETS
    llm = LLM(path, load_format="dummy" if dummy else "auto", enforce_eager=args.enforce_eager,
              max_model_len=args.prompt_len + args.output_len + 16,
              async_scheduling=(False if args.no_async_scheduling
                                else True if args.async_scheduling else None))
    if args.no_handoff:
        llm.install("structured_outputs").manager.can_hand_off = False
    timer = FillTimer(llm.install("structured_outputs").manager)
    phases = PhaseTimer(llm) if args.phases else None
    vocab = len(llm.tokenizer) - 1  # ordinary tokens only
    rng = Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    free = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    start = time.perf_counter()
    llm.install("structured_outputs").manager.compile(constrained.structured_outputs)
    compile_s = time.perf_counter() - start
    warm = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    # kernels, graphs and the grammar's first masks, on other prompts
    for sp in (free, constrained):
        llm.generate(warm, dataclasses.replace(sp, max_tokens=16), use_tqdm=False)
    results = {"free": [], "json": []}
    for _ in range(args.reps):
        results["free"].append(run(llm, prompts, free, timer, phases))
        results["json"].append(run(llm, prompts, constrained, timer, phases))
    median = {k: statistics.median(r["tok_per_s"] for r in v) for k, v in results.items()}
    record = {"model": args.model, "device": llm.config.device, "vocab": len(llm.tokenizer),
              "num_seqs": args.num_seqs, "prompt_len": args.prompt_len,
              "output_len": args.output_len,
              "temperature": args.temperature, "async_scheduling": llm.config.async_scheduling,
              "handoff": llm.install("structured_outputs").manager.can_hand_off,
              "enforce_eager": args.enforce_eager,
              "fill_threads": args.fill_threads,
              "torch_threads": torch.get_num_threads(),
              "bitmask_handoff": None
              if not (h := llm.install("structured_outputs").manager.handoff)
              else "device" if h.on_device else "host",
              "compile_s": round(compile_s, 3), "runs": results,
              "median_tok_per_s": median,
              "json_over_free": round(median["json"] / median["free"], 3)}
    llm.exit()
    if args.json:
        print(json.dumps(record))
    print(f"{args.num_seqs} requests x {args.output_len} tokens, vocab {record['vocab']}, async "
          f"{record['async_scheduling']}, handoff {record['handoff']}: "
          f"free {median['free']:,.0f} tok/s, "
          f"JSON schema {median['json']:,.0f} tok/s = {record['json_over_free']:.1%}; bitmask fill "
          f"{results['json'][-1]['fill_us_per_row']} us a row, "
          f"{results['json'][-1]['fill_share_of_wall']:.1%} "
          "of the wall time", file=sys.stderr)


if __name__ == "__main__":
    main()
