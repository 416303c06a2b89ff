# vLLM's examples/offline_inference/basic/chat.py (a conversation, a batch of them, a template's
# keywords), with the import line and the model changed.
import sys

from nanovllm import LLM, SamplingParams


def print_outputs(outputs):
    print("\nGenerated Outputs:\n" + "-" * 80)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\n")
        print(f"Generated text: {generated_text!r}")
        print("-" * 80)


def main():
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B")
    sampling_params = SamplingParams(temperature=0.5, max_tokens=32)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)
    outputs = llm.chat([conversation for _ in range(4)], sampling_params=sampling_params,
                       use_tqdm=True)
    print_outputs(outputs)
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False,
                       chat_template_kwargs={"enable_thinking": False})
    print_outputs(outputs)


if __name__ == "__main__":
    main()
