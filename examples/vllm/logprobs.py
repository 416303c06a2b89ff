# Sample and prompt logprobs as vLLM returns them (Logprob: logprob, rank, decoded_token), with the
# import line and the model changed.
import math
import sys

from nanovllm import LLM, SamplingParams


def main():
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "nanovllm:demo")
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=3)
    output = llm.generate(["import os\n"], params)[0]
    completion = output.outputs[0]
    print(f"{completion.text!r}: cumulative logprob {completion.cumulative_logprob:.3f}")
    for token_id, top in zip(completion.token_ids, completion.logprobs):
        chosen = top[token_id]
        print(f"  {chosen.decoded_token!r}: logprob {chosen.logprob:.3f} "
              f"(p={math.exp(chosen.logprob):.2f}), rank {chosen.rank}; "
              f"top: {[(lp.decoded_token, round(lp.logprob, 2)) for lp in top.values()][:5]}")
    print("prompt logprobs:",
          [None if e is None else {t: round(lp.logprob, 2) for t, lp in e.items()}
           for e in output.prompt_logprobs][:3])


if __name__ == "__main__":
    main()
