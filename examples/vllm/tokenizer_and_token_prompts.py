# The engine's tokenizer, token-id prompts (TokensPrompt), text prompts (TextPrompt), with the
# import line and the model changed.
import sys

from nanovllm import LLM, SamplingParams
from nanovllm.inputs import TextPrompt, TokensPrompt


def main():
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "nanovllm:demo")
    tokenizer = llm.get_tokenizer()
    token_ids = tokenizer.encode("class Stack:")
    outputs = llm.generate([TokensPrompt(prompt_token_ids=token_ids),
                            TextPrompt(prompt="class Stack:")],
                           SamplingParams(temperature=0, max_tokens=12))
    for output in outputs:
        print(output.prompt, output.prompt_token_ids[:8], repr(output.outputs[0].text))
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    print(tokenizer.decode(outputs[0].outputs[0].token_ids))


if __name__ == "__main__":
    main()
