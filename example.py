"""Complete Python snippets with nanovllm: `python example.py [--model PATH]`.

Without --model it runs the demo model shipped in the package (`LLM("nanovllm:demo")`): a tiny
Qwen3 trained on the Python standard library's source, small enough for a CPU. Each snippet is
completed twice: greedily (temperature 0) and sampled (--temperature; snippet i uses seed
--seed + i). --model takes any local Hugging Face checkpoint directory (e.g. Qwen3-0.6B); the
snippets are plain completion prompts.
"""
import argparse
import time

from nanovllm import LLM, SamplingParams

SNIPPETS = [
    "def fibonacci(n):",
    "class Stack:",
    "def is_prime(n):",
    "import os\n\ndef list_files(path):",
]


def show(title: str, prompts: list[str], outputs: list[dict]):
    print(f"\n{'=' * 30} {title} {'=' * 30}")
    for prompt, output in zip(prompts, outputs):
        print(f"\n--- {prompt.splitlines()[-1]!r} "
              f"({len(output['token_ids'])} tokens, {output['finish_reason']})")
        print(prompt + output["text"])


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="nanovllm:demo",
                        help="a local Hugging Face checkpoint directory "
                             "(default: the shipped demo model)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="of the sampled run")
    parser.add_argument("--seed", type=int, default=0, help="of the sampled run")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    start = time.perf_counter()
    # max_num_seqs: the snippets are all it runs
    # (a small KV cache on CPU, few CUDA Graphs to capture)
    llm = LLM(args.model, tensor_parallel_size=args.tp, device=args.device,
              enforce_eager=args.enforce_eager, max_num_seqs=len(SNIPPETS))
    where = f" ({llm.config.model})" if llm.config.model != args.model else ""
    print(f"Loaded {args.model}{where} on {llm.config.device} "
          f"in {time.perf_counter() - start:.1f} s")
    try:
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        # a seed per snippet: one seed for all would draw the same noise for each
        sampled = [SamplingParams(temperature=args.temperature, seed=args.seed + i,
                                  max_tokens=args.max_tokens)
                   for i in range(len(SNIPPETS))]
        show("greedy (temperature 0)", SNIPPETS, llm.generate(SNIPPETS, greedy, use_tqdm=False))
        show(f"sampled (temperature {args.temperature}, "
             f"seeds {args.seed}..{args.seed + len(SNIPPETS) - 1})",
             SNIPPETS, llm.generate(SNIPPETS, sampled, use_tqdm=False))
    finally:
        llm.exit()
    print(f"\nDone in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
