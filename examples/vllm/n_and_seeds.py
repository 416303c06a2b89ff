# n completions per prompt, reproducible by seed (vLLM's SamplingParams(n=..., seed=...)), with the
# import line and the model changed.
import sys

from nanovllm import LLM, SamplingParams


def main():
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "nanovllm:demo", seed=0)
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=16)
    first = llm.generate(["def add(a, b):"], params)
    again = llm.generate(["def add(a, b):"], params)
    for completion in first[0].outputs:
        print(completion.index, repr(completion.text), completion.finish_reason)
    assert [c.token_ids for c in first[0].outputs] == [c.token_ids for c in again[0].outputs]
    print("same seed, same completions")


if __name__ == "__main__":
    main()
