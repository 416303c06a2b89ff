# vLLM's LLM.beam_search, with the import line and the model changed.
import sys

from nanovllm import LLM
from nanovllm.beam_search import BeamSearchParams


def main():
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "nanovllm:demo")
    outputs = llm.beam_search([{"prompt": "def fibonacci(n):"}],
                              BeamSearchParams(beam_width=3, max_tokens=12))
    for sequence in outputs[0].sequences:
        print(f"{sequence.cum_logprob:8.3f} {sequence.text!r}")


if __name__ == "__main__":
    main()
