"""The user-facing API: outputs, stopping, seeded sampling, and errors that name the bad value."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import ENGINE, assert_no_leaks, edited_checkpoint, random_prompts

from nanovllm import LLM, SamplingParams


def test_outputs_in_prompt_order_and_text(llm, oracle, tiny):
    prompts = ["Hello, Nano-vLLM.", "a", "The quick brown fox jumps over the lazy dog " * 3]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 17, 9)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outputs):
        ids = llm.tokenizer.encode(prompt)
        assert out["token_ids"] == oracle.greedy(tiny, ids, sp.max_tokens)[0]
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    assert_no_leaks(llm)


def test_token_id_prompt_and_single_params(llm):
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [3, 3]


def test_stops_on_every_eos_id(tiny, oracle, tmp_path):
    prompt = random_prompts(1, 10, 10, seed=11)[0]
    ref, _ = oracle.greedy(tiny, prompt, 32)
    stop_token = ref[5]
    ckpt = tmp_path / "eos"
    shutil.copytree(tiny, ckpt)
    with open(ckpt / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [stop_token, 300]}, f)
    engine = LLM(str(ckpt), **ENGINE)
    try:
        assert set(engine.config.eos_token_ids) == {stop_token, 300, engine.tokenizer.eos_token_id}
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
        ignored = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                  use_tqdm=False)[0]
    finally:
        engine.exit()
    assert out["token_ids"] == ref[:ref.index(stop_token) + 1]
    assert ignored["token_ids"] == ref


def test_stops_at_max_model_len(tiny):
    engine = LLM(tiny, kvcache_block_size=16, max_model_len=40, num_kvcache_blocks=64)
    try:
        out = engine.generate([list(range(30))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                              use_tqdm=False)[0]
    finally:
        engine.exit()
    assert len(out["token_ids"]) == 10 and out["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible(tiny):
    prompts = random_prompts(6, 5, 30, seed=12)
    sp = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
    runs = []
    for seed in (0, 0, 1):
        engine = LLM(tiny, **ENGINE, seed=seed)
        try:
            runs.append([o["token_ids"] for o in engine.generate(prompts, sp, use_tqdm=False)])
        finally:
            engine.exit()
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_unknown_keyword_is_named(tiny):
    with pytest.raises(TypeError, match="max_num_seq'"):
        LLM(tiny, max_num_seq=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(kvcache_block_size="16"), "kvcache_block_size"),
    (dict(dtype="float64"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3"),
])
def test_bad_config_values(tiny, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LLM(tiny, **kwargs)


def test_bad_model_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_missing_weights(tiny, tmp_path):
    ckpt = tmp_path / "noweights"
    shutil.copytree(tiny, ckpt, ignore=shutil.ignore_patterns("*.safetensors*"))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(ckpt))


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature="hot"), "temperature"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompts, params, match", [
    ([[]], None, "empty"),
    ([[1, 2, 999]], None, "outside the vocabulary"),
    ([[1, -2]], None, "outside the vocabulary"),
    ([[1, 2.5]], None, "list of ints"),
    ([[7] * 600], None, "max_model_len"),
    (["a", "b"], [SamplingParams()], "2 prompts but 1"),
    ([1.5], None, "a string, a list of ints or a dict"),
    (["a"], SamplingParams(logprobs=321), "logprobs must be <= the vocabulary size 320, got 321"),
    (["a"], SamplingParams(prompt_logprobs=10_000), "prompt_logprobs must be <= the vocabulary size 320"),
])
def test_bad_prompts_leave_engine_usable(llm, prompts, params, match):
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate(prompts, params or SamplingParams(), use_tqdm=False)
    assert llm.is_finished()
    assert len(llm.generate(["ok"], SamplingParams(max_tokens=2), use_tqdm=False)[0]["token_ids"]) <= 2


def test_example_runs_without_arguments(tmp_path):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "example.py"), "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nanovllm:demo" in proc.stdout and "def fibonacci(n):" in proc.stdout
    assert "greedy (temperature 0)" in proc.stdout and "sampled (temperature 0.8" in proc.stdout


def test_prompt_larger_than_the_kv_cache(tiny, caplog):
    engine = LLM(tiny, kvcache_block_size=16, num_kvcache_blocks=2)
    try:
        # max_model_len is lowered to what the cache holds, and says so (vLLM refuses such a start instead)
        assert engine.config.max_model_len == 32
        assert "max_model_len lowered from 1024 to 32" in caplog.text
        with pytest.raises(ValueError, match=r"max_model_len=32 \(the whole KV cache holds 32 tokens\)"):
            engine.generate([[5] * 40], SamplingParams(), use_tqdm=False)
        out = engine.generate([[5] * 20], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                              use_tqdm=False)[0]
    finally:
        engine.exit()
    assert len(out["token_ids"]) == 12  # stops when the sequence fills the whole cache


def test_unsupported_architecture(tiny, tmp_path):
    ckpt = tmp_path / "arch"
    shutil.copytree(tiny, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: .*'LlamaForCausalLM'.*'Qwen3ForCausalLM'"):
        LLM(str(ckpt))


def test_running_sequences_capped_by_max_num_seqs(tiny):
    engine = LLM(tiny, **{**ENGINE, "max_num_seqs": 3})
    try:
        for prompt in random_prompts(7, 3, 20, seed=13):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        while not engine.is_finished():
            engine.step()
            assert len(engine.scheduler.running) <= 3
        assert_no_leaks(engine)
    finally:
        engine.exit()


def test_weights_not_matching_config_name_the_tensor(tiny, tmp_path):
    ckpt = edited_checkpoint(tiny, tmp_path / "shapes", intermediate_size=lambda n: 2 * n)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.\d\.mlp\.(gate|up|down)_proj\.weight'"):
        LLM(ckpt, device="cpu")


def test_attention_backend_choice_is_checked_up_front(tiny):
    with pytest.raises(ValueError, match="attention_backend must be"):
        LLM(tiny, attention_backend="xformers")
    with pytest.raises(ValueError, match=r"attention_backend='flash-attn' does not support.*kvcache_block_size 16"):
        LLM(tiny, device="cpu", kvcache_block_size=16, attention_backend="flash-attn")


def test_auto_backend_on_cpu_is_the_reference(llm):
    assert llm.model_runner.attention_backend.name == ("triton" if llm.config.device == "cuda" else "torch")


def test_kv_budget_too_small_for_one_block(tiny):
    with pytest.raises(ValueError, match="no memory left for the KV cache.*cpu_kvcache_space"):
        LLM(tiny, device="cpu", cpu_kvcache_space=1e-9)


def test_checkpoint_tensor_with_unknown_name_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file
    ckpt = tmp_path / "names"
    shutil.copytree(tiny, ckpt)
    weights = load_file(str(ckpt / "model.safetensors"))
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(weights, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.0.mlp.extra_proj.weight'.*matches no parameter"):
        LLM(str(ckpt), device="cpu")


def test_wrong_sampling_params_type(llm):
    with pytest.raises(TypeError, match="sampling_params must be"):
        llm.generate(["a"], {"temperature": 0}, use_tqdm=False)
