"""The host side of structured outputs alone: one step's token bitmask for ``--num-seqs`` JSON-schema matchers
(tools/bench_structured.py's schema and trained 151,643-token tokenizer), filled by each method of
``nanovllm.engine.structured_output.fill_rows`` at each thread count, on the same matcher states; no model.

The matchers are driven as a random-weight model under the mask drives them: each step every matcher accepts
one token drawn uniformly from its allowed set (``--seed``), so they spread over the schema's states (free
whitespace, strings, numbers, keys). Each step times every method once, on the states of that step.

    python tools/bench_fill.py [--num-seqs 64] [--steps 100] [--threads 1 2 4 8] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from random import Random

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_structured import SCHEMA, model_dir  # noqa: E402

from nanovllm.engine import structured_output  # noqa: E402


def allowed_token(bitmask_row: torch.Tensor, vocab: int, rng: Random) -> int | None:
    """A token drawn uniformly from those a bitmask row allows (below ``vocab``), or None if none is."""
    bits = (bitmask_row.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    tokens = torch.nonzero(bits.view(-1)[:vocab]).view(-1)
    return None if tokens.numel() == 0 else int(tokens[rng.randrange(tokens.numel())])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--vocab-size", type=int, default=151643)
    parser.add_argument("--work", default=os.environ.get("BENCH_WORK", "/tmp/nanovllm-bench-structured"))
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer
    path = model_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    manager = structured_output.StructuredOutputManager(tokenizer, vocab_size, (tokenizer.eos_token_id,))
    params = structured_output.StructuredOutputsParams(json=SCHEMA)
    matchers = [manager.grammar(params).matcher for _ in range(args.num_seqs)]
    bitmask = torch.full(structured_output.import_xgrammar().get_bitmask_shape(args.num_seqs, vocab_size), -1,
                         dtype=torch.int32)
    methods = [(m, n) for m in structured_output.FILL_METHODS for n in args.threads]
    times = {f"{m}-{n}": [] for m, n in methods}
    rng = Random(args.seed)
    for _ in range(args.steps):
        live = [(row, m) for row, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        for method, threads in methods:
            start = time.perf_counter()
            structured_output.fill_rows(live, bitmask, threads, method)
            times[f"{method}-{threads}"].append(time.perf_counter() - start)
        for row, matcher in live:
            token = allowed_token(bitmask[row], len(tokenizer), rng)
            if token is not None and not matcher.accept_token(token):
                raise RuntimeError(f"matcher {row} refused token {token} that its bitmask allowed")
    record = {"num_seqs": args.num_seqs, "steps": len(next(iter(times.values()))), "vocab": vocab_size,
              "cpus": len(os.sched_getaffinity(0)), "ms_per_step": {
                  k: {"median": round(1e3 * statistics.median(v), 3), "mean": round(1e3 * statistics.mean(v), 3)}
                  for k, v in times.items()},
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.json:
        print(json.dumps(record))
    for k, v in record["ms_per_step"].items():
        print(f"{k:10} {v['median']:7.2f} ms median, {v['mean']:7.2f} mean a step of {args.num_seqs} rows",
              file=sys.stderr)


if __name__ == "__main__":
    main()
