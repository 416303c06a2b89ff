"""Every supported family (Qwen3, Qwen2/2.5, Llama 2/3.x, Mistral) from tiny random checkpoints:
greedy output equal to transformers' token for token on CPU, one with TP=2 on gloo."""
from __future__ import annotations

import pytest
from conftest import assert_matches_oracle, assert_no_leaks, random_prompts
from tiny_model import build_tiny_model

from nanovllm import LLM, SamplingParams

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
FAMILIES = {  # name: (architecture, build_tiny_model overrides)
    "qwen2_biases": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama3_rope_tied": ("llama", dict(head_dim=32, tie_word_embeddings=True, rope_theta=500000.0,
                                       rope_scaling=LLAMA3_ROPE)),
    "llama_linear_rope_all_biases": ("llama", dict(head_dim=32, attention_bias=True, mlp_bias=True,
                                                   num_key_value_heads=4, rope_scaling=dict(rope_type="linear",
                                                                                            factor=2.0))),
    "mistral": ("mistral", dict(head_dim=32, sliding_window=None, num_key_value_heads=1)),
}
N = 32


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build_tiny_model(str(root / name), arch, **kw) for name, (arch, kw) in FAMILIES.items()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(family_checkpoints, oracle, name):
    """Also with the engine's features on: prefix-cache hits (a second wave sharing the first's
    prefixes), chunked prefill (40-token budget) and preemption (a 40-block cache)."""
    path = family_checkpoints[name]
    prompts = random_prompts(16, 3, 90, seed=70)  # positions past the llama3 rope's original 64
    again = [p + [1, 2] for p in prompts[-3:]]  # finished last: their blocks are still cached
    llm = LLM(path, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=40, max_num_batched_tokens=40,
              device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    try:
        assert type(llm.model_runner.model).__name__ == llm.config.hf_config.architectures[0]
        outputs = llm.generate(prompts, sp, use_tqdm=False) + llm.generate(again, sp, use_tqdm=False)
        assert llm.scheduler.block_manager.num_cache_hits > 0
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert_matches_oracle(oracle, path, prompts + again, outputs, N)


def test_llama_tensor_parallel(family_checkpoints, oracle):
    path = family_checkpoints["llama_linear_rope_all_biases"]
    prompts = random_prompts(8, 3, 60, seed=71)
    llm = LLM(path, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=512, device="cpu",
              tensor_parallel_size=2)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    finally:
        llm.exit()
    assert_matches_oracle(oracle, path, prompts, outputs, N)


def test_sliding_window_shorter_than_max_model_len_is_refused(tmp_path):
    path = build_tiny_model(str(tmp_path / "mistral"), "mistral", head_dim=32, sliding_window=128)
    with pytest.raises(ValueError, match="sliding_window=128 is shorter than max_model_len=512"):
        LLM(path, max_model_len=512, device="cpu")
    llm = LLM(path, max_model_len=128, num_kvcache_blocks=16, kvcache_block_size=16, device="cpu")  # fits the window
    llm.exit()


def test_unsupported_rope_type_is_named(tmp_path):
    path = build_tiny_model(str(tmp_path / "yarn"), "llama", head_dim=32,
                            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256))
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        LLM(path, device="cpu", num_kvcache_blocks=16)


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b"])
def test_presets_build_their_architecture(preset):
    """Each preset's config builds (on the meta device: no memory) with the expected parameter count."""
    import torch

    from nanovllm.models import get_model_class
    from nanovllm.models.presets import preset_config
    from nanovllm.utils.distributed import tensor_parallel
    config = preset_config(preset)
    with torch.device("meta"), tensor_parallel(0, 1):
        model = get_model_class(config)(config)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    expected = {"qwen3-0.6b": 0.60, "qwen3-8b": 8.19, "llama-3.2-1b": 1.24, "llama-3.1-8b": 8.03, "qwen2.5-7b": 7.62}
    assert params == pytest.approx(expected[preset], abs=0.02), params
