"""Specification of ``LLM.update_weights``: an engine started on checkpoint A and given checkpoint
B's transformers ``named_parameters()`` generates B's greedy output token for token (TP=1 and TP=2,
tied embeddings, online fp8); a bad name or shape is refused before anything changes; parameters
keep their storage; the prefix cache is reset; an update while requests run is refused."""
from __future__ import annotations

import pytest
import torch
from conftest import CPU_ENGINE, assert_matches_oracle, random_prompts, token_ids_of
from tiny_model import build_tiny_qwen3

from nanovllm import LLM, SamplingParams

N = 12
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
# longer than a block: their full blocks enter the prefix cache
PROMPTS = random_prompts(4, 20, 60, seed=41)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """Checkpoints A and B: one architecture, different random weights."""
    root = tmp_path_factory.mktemp("update")
    return build_tiny_qwen3(str(root / "a"), seed=0), build_tiny_qwen3(str(root / "b"), seed=1)


def weights_of(oracle, path: str) -> list[tuple[str, torch.Tensor]]:
    return list(oracle.model(path).named_parameters())


def generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return token_ids_of(llm.generate(prompts, GREEDY, use_tqdm=False))


def storage(llm: LLM) -> dict[str, int]:
    model = llm.model_runner.model
    return {name: t.data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def test_update_weights_gives_the_new_model(pair, oracle):
    a, b = pair
    with LLM(a, **CPU_ENGINE) as llm:
        before, ptrs = generate(llm), storage(llm)
        assert llm.scheduler.block_manager.hash_to_block_id  # A's prompts are cached
        llm.update_weights(weights_of(oracle, b))
        hits = llm.scheduler.block_manager.num_cache_hits
        after = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        # the prefix cache was reset: no A prefix reused
        assert llm.scheduler.block_manager.num_cache_hits == hits
        # every parameter and buffer kept its storage (CUDA graphs stay valid)
        assert storage(llm) == ptrs
    assert_matches_oracle(oracle, b, PROMPTS, after, N)
    assert_matches_oracle(oracle, a, PROMPTS, [{"token_ids": t} for t in before], N)
    assert token_ids_of(after) != before


def test_update_weights_tensor_parallel(pair, oracle, monkeypatch):
    """TP=2: each worker gets the full tensors over the call channel, in batches that keep the
    shared memory at its first size, and keeps its shard."""
    from nanovllm.engine import worker_group
    from nanovllm.features import weight_update
    a, b = pair
    monkeypatch.setattr(weight_update, "UPDATE_BATCH_BYTES", 2 ** 16)
    assert len(list(weight_update.weight_batches(weights_of(oracle, b), 2 ** 16))) > 2
    with LLM(a, **CPU_ENGINE, tensor_parallel_size=2) as llm:
        generate(llm)
        llm.update_weights(weights_of(oracle, b))
        assert llm.workers.channel.shm.size == worker_group.SEGMENT_SIZE
        after = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="'model.norm.weight'.*has shape"):
            llm.update_weights([*weights_of(oracle, a)[:-1], ("model.norm.weight", torch.ones(3))])
        assert generate(llm) == token_ids_of(after)
    assert_matches_oracle(oracle, b, PROMPTS, after, N)


def test_tied_embeddings_and_bf16_tensors(tmp_path, oracle):
    """A tied model's parameters come without ``lm_head.weight`` (the embedding sets both), or with
    it; any float dtype is cast to the model's."""
    a, b = (build_tiny_qwen3(str(tmp_path / name), seed=seed, tie_word_embeddings=True)
            for name, seed in (("a", 0), ("b", 1)))
    weights = weights_of(oracle, b)
    assert not any(name == "lm_head.weight" for name, _ in weights)
    with LLM(a, **CPU_ENGINE) as llm:
        llm.update_weights(weights)
        after = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.update_weights([(name, t.to(torch.bfloat16))
                            for name, t in oracle.model(a).state_dict().items()])
        assert "lm_head.weight" in oracle.model(a).state_dict()
        assert generate(llm) != token_ids_of(after)  # A's weights, rounded to bf16
    assert_matches_oracle(oracle, b, PROMPTS, after, N)


@pytest.mark.parametrize("bad, message", [
    (("model.layers.0.mlp.nope.weight", torch.zeros(4)),
     "'model.layers.0.mlp.nope.weight' matches no parameter"),
    (("model.layers.1.mlp.down_proj.weight", torch.zeros(64, 127)),
     r"'model.layers.1.mlp.down_proj.weight'.*has shape \(64, 127\) "
     r"but the model expects \(64, 128\)"),
    (("model.layers.1.self_attn.k_proj.weight", torch.zeros(32, 64)),
     r"'model.layers.1.self_attn.k_proj.weight'"),
])
def test_refused_update_changes_nothing(pair, oracle, bad, message):
    """The bad tensor comes last: had the others been loaded as they were checked, the outputs would
    be B's."""
    a, b = pair
    with LLM(a, **CPU_ENGINE) as llm:
        before = generate(llm)
        with pytest.raises(ValueError, match=message):
            llm.update_weights([*weights_of(oracle, b), bad])
        assert generate(llm) == before


def test_bad_arguments_are_type_errors(pair):
    with LLM(pair[0], **CPU_ENGINE) as llm:
        with pytest.raises(TypeError, match="iterable of"):
            llm.update_weights(torch.zeros(3))
        with pytest.raises(TypeError, match=r"weights\[0\] must be a \(name, tensor\) pair"):
            llm.update_weights([("model.norm.weight",)])
        with pytest.raises(TypeError, match="'model.norm.weight' is torch.int64"):
            llm.update_weights([("model.norm.weight", torch.ones(64, dtype=torch.int64))])


def test_refused_while_requests_run(pair, oracle):
    a, b = pair
    with LLM(a, **CPU_ENGINE) as llm:
        request = llm.add_request(PROMPTS[0], GREEDY)
        llm.step()
        with pytest.raises(ValueError, match="1 completions are unfinished"):
            llm.update_weights(weights_of(oracle, b))
        llm.abort_request(request)
        llm.update_weights(weights_of(oracle, b))
        after = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_matches_oracle(oracle, b, PROMPTS, after, N)


def test_online_fp8_quantizes_the_new_weights(pair, oracle):
    """``quantization="fp8"``: the float tensors are quantized by the layers' online loader, as at
    load."""
    a, b = pair
    with LLM(b, **CPU_ENGINE, quantization="fp8") as llm:
        expected = generate(llm)
    with LLM(a, **CPU_ENGINE, quantization="fp8") as llm:
        ptrs = storage(llm)
        llm.update_weights(weights_of(oracle, b))
        assert generate(llm) == expected
        assert storage(llm) == ptrs


def test_tensors_the_model_cannot_take_are_refused_by_name(pair, oracle):
    """An e4m3 tensor for a layer that is not fp8 (it was cast silently), a meta or sparse tensor
    (they failed in the copy), and the engine's own packed names (a raw TypeError): each refused
    naming the tensor, nothing changed."""
    a, b = pair
    weights = dict(weights_of(oracle, b))
    norm, embed = "model.norm.weight", "model.embed_tokens.weight"
    with LLM(a, **CPU_ENGINE) as llm:
        before = generate(llm)
        with pytest.raises(ValueError, match=rf"'{norm}' is torch.float8_e4m3fn but the model "
                                             r"expects torch.float32"):
            llm.update_weights([(norm, weights[norm].to(torch.float8_e4m3fn))])
        with pytest.raises(TypeError, match=rf"'{embed}' is on the meta device"):
            llm.update_weights([(embed, torch.empty_like(weights[embed], device="meta"))])
        with pytest.raises(TypeError, match=rf"'{embed}' is of layout torch.sparse_coo"):
            llm.update_weights([(embed, weights[embed].detach().to_sparse())])
        packed = "model.layers.0.self_attn.qkv_proj.weight"
        qkv = dict(llm.model_runner.model.named_parameters())[packed]
        with pytest.raises(ValueError, match=rf"'{packed}' is this engine's packed parameter"):
            llm.update_weights([(packed, qkv.detach().clone())])
        assert generate(llm) == before


def test_fp8_tensors_reach_the_workers_of_two_cpu_ranks(pair, tmp_path):
    """A block-fp8 checkpoint's (weight, scale) pairs through update_weights at TP 2 on CPU: they
    used to kill rank 1 (float8 tensors do not survive the call channel's pickle); the engine now
    generates what one started on those weights at TP 2 does."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    from quantize_fp8 import quantize_checkpoint
    from safetensors.torch import load_file
    a, b = (quantize_checkpoint(p, str(tmp_path / name), 32) for p, name in zip(pair, "ab"))
    weights = list(load_file(os.path.join(b, "model.safetensors")).items())
    assert any(t.dtype == torch.float8_e4m3fn for _, t in weights)
    with LLM(b, **CPU_ENGINE, tensor_parallel_size=2) as llm:  # the same ranks' arithmetic
        expected = generate(llm)
    with LLM(a, **CPU_ENGINE, tensor_parallel_size=2) as llm:
        llm.update_weights(weights)
        assert generate(llm) == expected
        assert generate(llm) == expected  # rank 1 alive: a second generate needs it
