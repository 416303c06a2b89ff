"""Greedy output equals transformers' token for token, with each engine feature forced on."""
from __future__ import annotations

import pytest
from conftest import CHECKPOINTS, ENGINE, assert_matches_oracle, assert_no_leaks, random_prompts

from nanovllm import LLM, SamplingParams

N = 32
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def run(path, prompts, **kw):
    llm = LLM(path, **{**ENGINE, **kw})
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_no_leaks(llm)
        return outputs, llm
    finally:
        llm.exit()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_transformers(checkpoints, oracle, name):
    prompts = random_prompts(16, 3, 70, seed=1)  # lengths cross 16-token block boundaries
    outputs, _ = run(checkpoints[name], prompts)
    assert_matches_oracle(oracle, checkpoints[name], prompts, outputs, N)


def test_prefix_cache_hits(tiny, oracle):
    shared = random_prompts(1, 50, 50, seed=2)[0]
    first = [shared + [1, 2, 3]]
    others = [shared + tail for tail in random_prompts(8, 1, 20, seed=3)]
    llm = LLM(tiny, **ENGINE)
    try:
        out1 = llm.generate(first, GREEDY, use_tqdm=False)
        hits_before = llm.scheduler.block_manager.num_cache_hits
        out2 = llm.generate(others, GREEDY, use_tqdm=False)
        hits = llm.scheduler.block_manager.num_cache_hits - hits_before
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert hits >= 8 * (50 // 16), f"only {hits} prefix-cache block hits"
    assert_matches_oracle(oracle, tiny, first + others, out1 + out2, N)


@pytest.mark.parametrize("budget", [7, 40])
def test_chunked_prefill(tiny, oracle, budget):
    prompts = random_prompts(16, 3, 70, seed=4)
    outputs, _ = run(tiny, prompts, max_num_batched_tokens=budget)
    assert_matches_oracle(oracle, tiny, prompts, outputs, N)


def test_preemption(tiny, oracle):
    prompts = random_prompts(16, 20, 60, seed=5)
    llm = LLM(tiny, **{**ENGINE, "num_kvcache_blocks": 12})  # 192 slots for 16 sequences of up to 92 tokens
    try:
        assert llm.config.num_kvcache_blocks == 12
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert llm.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"
    assert_matches_oracle(oracle, tiny, prompts, outputs, N)


def test_tensor_parallel_gloo(checkpoints, oracle):
    path = checkpoints["gqa4_hd128_sharded"]
    prompts = random_prompts(16, 3, 70, seed=6)
    outputs, _ = run(path, prompts, tensor_parallel_size=2, device="cpu")
    assert_matches_oracle(oracle, path, prompts, outputs, N)


def test_large_batch(tiny, oracle):
    prompts = random_prompts(160, 2, 40, seed=7)
    outputs, _ = run(tiny, prompts, max_num_seqs=64)
    assert_matches_oracle(oracle, tiny, prompts, outputs, N)


def test_two_engines_in_one_process(checkpoints, oracle):
    a, b = checkpoints["gqa2"], checkpoints["gqa1_tied"]
    prompts = random_prompts(4, 3, 30, seed=8)
    llm_a = LLM(a, **ENGINE)
    llm_b = LLM(b, **ENGINE, tensor_parallel_size=2, device="cpu")  # side by side with a TP engine
    try:
        out_a = llm_a.generate(prompts, GREEDY, use_tqdm=False)
        out_b = llm_b.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm_b.exit()
        llm_a.exit()
    assert_matches_oracle(oracle, a, prompts, out_a, N)
    assert_matches_oracle(oracle, b, prompts, out_b, N)
    out_again, _ = run(b, prompts, tensor_parallel_size=2, device="cpu")  # one after another
    assert [o["token_ids"] for o in out_again] == [o["token_ids"] for o in out_b]


def test_triton_backend(checkpoints, oracle):
    """The whole engine through the Triton kernels (interpreted on CPU), prefix cache and chunks included."""
    path = checkpoints["gqa4_hd128_sharded"]
    shared = random_prompts(1, 40, 40, seed=9)[0]
    prompts = random_prompts(4, 3, 40, seed=10) + [shared + [1], shared + [2, 3]]
    llm = LLM(path, **{**ENGINE, "attention_backend": "triton", "max_num_batched_tokens": 64})
    try:
        assert llm.model_runner.attention_backend.name == "triton"
        outputs = llm.generate(prompts[:5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
        outputs += llm.generate(prompts[5:], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
        assert llm.scheduler.block_manager.num_cache_hits >= 2
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert_matches_oracle(oracle, path, prompts, outputs, 12)
