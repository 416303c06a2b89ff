"""Scripts in the shape of vLLM's offline examples (``examples/vllm/``: vLLM's code with the import
line and the model changed) run unchanged, each in its own process, on the shipped demo model (chat:
a tiny checkpoint with a chat template). Each must exit 0 and print what its vLLM original
prints."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {  # script -> lines its output must hold
    "basic.py": ["Prompt:    'The capital of France is'", "Output:    "],
    "n_and_seeds.py": ["same seed, same completions"],
    "logprobs.py": ["cumulative logprob", "rank 1", "prompt logprobs: [None, {"],
    "tokenizer_and_token_prompts.py": ["class Stack: ["],
    "stop_conditions.py": ["stop_reason='\\n'", "finish_reason='length', stop_reason=None"],
    "engine_loop.py": ["RequestOutput(request_id='0', "
                       "prompt='A robot may not injure a human being'", "finished=True"],
    "default_sampling_params.py": ["'def is_prime(n):'"],
    "prefix_caching.py": ["Generated answers are the same: True"],
    "beam_search.py": ["'def fibonacci(n):"],
    "chat.py": ["Generated text: "],
    "generate.py": ["Prompt: 'Hello, my name is', Generated text: "],
    "metrics.py": ["vllm:num_requests_running (gauge) = 0", "vllm:prompt_tokens (counter) = ",
                   "vllm:request_success (counter) = "],
    "structured_outputs.py": ["choice: 'Positive' (finish_reason='stop')", "parsed: brand=",
                              "grammar: 'SELECT name FROM orders' (finish_reason='stop')"],
    "custom_logits_processor.py": ["Prompt:    'The capital of France is'",
                                   "Output:    'cccccccccccccccc"],
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_vllm_shaped_script_runs(script, tiny):
    if script == "structured_outputs.py":
        pytest.importorskip("xgrammar")  # the structured extra
    # the demo model has no chat template; the engine loop and generate parse vLLM's engine flags
    # (underscores too)
    args = {"chat.py": [tiny], "engine_loop.py": ["--max-model-len", "512", "--block-size", "16"],
            "generate.py": ["--max-model-len", "512", "--block_size", "16",
                            "--max_tokens", "8"]}.get(script, [])
    env = dict(os.environ, PYTHONPATH=ROOT, TQDM_DISABLE="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "vllm", script), *args],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in SCRIPTS[script]:
        assert line in out.stdout, f"{line!r} not in the output of {script}:\n{out.stdout[-2000:]}"
    # its shared prefix (222 demo tokens) is reused at the default block size
    if script == "prefix_caching.py":
        cached = [int(n) for n in re.findall(r"cached tokens: (\d+)", out.stdout)]
        assert len(cached) == 4 and min(cached) >= 192, out.stdout[-2000:]
