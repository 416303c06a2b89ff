# The checkpoint's own sampling defaults (generation_config.json), as vLLM's examples start from
# them, with the import line and the model changed.
import sys

from nanovllm import LLM


def main():
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "nanovllm:demo")
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens = 16
    for output in llm.generate(["def is_prime(n):"], sampling_params):
        print(repr(output.prompt), repr(output.outputs[0].text))
    # sampling_params None: the defaults
    print(llm.generate(["def is_prime(n):"])[0].outputs[0].finish_reason)


if __name__ == "__main__":
    main()
