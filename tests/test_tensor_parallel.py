"""Tensor parallelism at 4 and 8 ranks (gloo, on CPU): a tiny checkpoint with 8 query and 8 KV heads,
so that every rank holds one head of each, gives transformers' greedy output token for token."""
from __future__ import annotations

import pytest
from conftest import assert_matches_oracle, random_prompts
from tiny_model import build_tiny_qwen3

from nanovllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def kv8(tmp_path_factory):
    return build_tiny_qwen3(str(tmp_path_factory.mktemp("kv8") / "m"), num_attention_heads=8, num_key_value_heads=8,
                            head_dim=32, intermediate_size=256)


@pytest.mark.parametrize("tp", [4, 8])
def test_tensor_parallel_4_and_8(kv8, oracle, tp):
    prompts = random_prompts(8, 3, 60, seed=90)
    llm = LLM(kv8, tensor_parallel_size=tp, device="cpu", kvcache_block_size=16, num_kvcache_blocks=128,
              max_model_len=256)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        llm.exit()
    assert_matches_oracle(oracle, kv8, prompts, outputs, 16)
