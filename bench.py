"""Throughput on nano-vllm's workload: 256 sequences, prompt and output lengths uniform in
[100, 1024] (seed 0), temperature 0.6, ignore_eos. Prints output tokens, time and tok/s.

`python bench.py --model PATH`; without --model a tiny random model is built (CPU smoke run).
"""
import argparse
import json
import os
import tempfile
import time
from random import randint, seed

from nanovllm import LLM, SamplingParams


def workload(num_seqs: int, max_input_len: int, max_output_len: int, min_len: int = 100):
    """nano-vllm's bench workload: all prompts are drawn first, then all output lengths."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(min_len, max_input_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(min_len, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="print one JSON result line")
    args = parser.parse_args()

    path = args.model
    if path is None:
        from nanovllm.utils.tiny_model import build_tiny_qwen3
        path = build_tiny_qwen3(os.path.join(tempfile.gettempdir(), "nanovllm-bench-tiny"), vocab_size=10240,
                                max_position_embeddings=4096)
    llm = LLM(path, tensor_parallel_size=args.tp, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len)
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # warmup
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    total = sum(sp.max_tokens for sp in params)
    result = dict(model=path, device=llm.config.device, tp=args.tp, enforce_eager=args.enforce_eager,
                  num_seqs=args.num_seqs, output_tokens=total, seconds=round(elapsed, 3),
                  tok_per_s=round(total / elapsed, 1), date=time.strftime("%Y-%m-%d"))
    llm.exit()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s")


if __name__ == "__main__":
    main()
