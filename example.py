"""Generate with nanovllm: `python example.py [--model PATH]`.

Without --model a tiny random Qwen3 is built locally (no download): it runs the whole engine
but its weights are random, so its text is noise.
"""
import argparse
import os
import tempfile

from nanovllm import LLM, SamplingParams


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Hugging Face checkpoint directory (Qwen3)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    path = args.model
    if path is None:
        from nanovllm.utils.tiny_model import build_tiny_qwen3
        path = build_tiny_qwen3(os.path.join(tempfile.gettempdir(), "nanovllm-tiny-random"))
        print(f"No --model given: built a tiny Qwen3 with random weights in {path} (its output is noise).")

    llm = LLM(path, tensor_parallel_size=args.tp, device=args.device, enforce_eager=args.enforce_eager)
    tokenizer = llm.tokenizer
    prompts = ["introduce yourself", "list all prime numbers within 100"]
    if tokenizer.chat_template:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        print(f"\nPrompt: {prompt!r}\nCompletion: {output['text']!r}")
    llm.exit()


if __name__ == "__main__":
    main()
