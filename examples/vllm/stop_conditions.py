# Stop strings, stop token ids, min_tokens; finish_reason and stop_reason as vLLM sets them, with
# the import line and the model changed.
import sys

from nanovllm import LLM, SamplingParams


def main():
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "nanovllm:demo")
    tokenizer = llm.get_tokenizer()
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    for params in [SamplingParams(temperature=0, max_tokens=40, stop=["\n"]),
                   SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[newline]),
                   SamplingParams(temperature=0, max_tokens=40, stop=["\n"],
                                  include_stop_str_in_output=True),
                   SamplingParams(temperature=0, max_tokens=5, min_tokens=5, ignore_eos=True)]:
        output = llm.generate(["def fibonacci(n):"], params, use_tqdm=False)[0].outputs[0]
        print(f"{output.text!r}: finish_reason={output.finish_reason!r}, "
              f"stop_reason={output.stop_reason!r}")


if __name__ == "__main__":
    main()
