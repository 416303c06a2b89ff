"""Specification of the model families and checkpoint loading: every supported family (Qwen3,
Qwen2/2.5, Llama 2/3.x, Mistral) from tiny random checkpoints gives transformers' greedy output
token for token on CPU; the presets build; one rotary table per model; and checkpoints as they come:
sharded with an index (and foreign files beside), with old rotary buffers, wrong shapes (under
tensor parallelism too), damaged files, unknown tensors, no weights, no tokenizer, an unsupported
architecture. The loader tests build and load models directly (no engine)."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil

import pytest
import torch
from conftest import (
    FAMILIES,
    LLAMA3_ROPE,
    assert_matches_oracle,
    assert_no_leaks,
    edited_checkpoint,
    generate_with_features,
    random_prompts,
    run_engine,
)
from safetensors.torch import load_file, save_file
from tiny_model import build_tiny_model, build_tiny_qwen3
from transformers import AutoConfig

from nanovllm import LLM, SamplingParams
from nanovllm.layers.rotary_embedding import get_rope
from nanovllm.models import get_model_class
from nanovllm.models.llama import head_dim_of
from nanovllm.plugins import REGISTRY
from nanovllm.utils import loader
from nanovllm.utils.distributed import tensor_parallel

N = 32


# ---- every family against transformers -----------------------------------------------------------
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(family_checkpoints, oracle, name):
    """Also with the engine's features on: prefix-cache hits (a second wave sharing the first's
    prefixes), chunked prefill (40-token budget) and preemption (a 40-block cache)."""
    path = family_checkpoints[name]

    def check(llm):
        assert type(llm.model_runner.model).__name__ == llm.config.hf_config.architectures[0]
    # positions past the llama3 rope's original 64
    prompts, outputs = generate_with_features(path, random_prompts(16, 3, 90, seed=70), N, check)
    assert_matches_oracle(oracle, path, prompts, outputs, N)


def test_sliding_windows_per_layer():
    """Each layer's window as transformers reads the config: layer_types (Qwen2 and Qwen3 derive
    them from use_sliding_window and max_window_layers, or take them as given), Mistral's and
    Qwen3-MoE's on every layer; a window of max_model_len or more is full attention; unknown layer
    types are refused by name."""
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    from nanovllm.models.llama import sliding_windows
    assert sliding_windows(Qwen2Config(num_hidden_layers=4, use_sliding_window=True,
                                       sliding_window=8, max_window_layers=2)) == [0, 0, 8, 8]
    assert sliding_windows(Qwen2Config(num_hidden_layers=3, use_sliding_window=False,
                                       sliding_window=8)) == [0] * 3
    assert sliding_windows(Qwen3Config(num_hidden_layers=4, sliding_window=8,
                                       use_sliding_window=True,
                                       layer_types=["sliding_attention", "full_attention"] * 2)) \
        == [8, 0, 8, 0]
    assert sliding_windows(MistralConfig(num_hidden_layers=2, sliding_window=16)) == [16, 16]
    assert sliding_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [0, 0]
    from transformers import (
        Qwen3MoeConfig,  # no layer_types: every layer windowed when use_sliding_window
    )
    assert sliding_windows(Qwen3MoeConfig(num_hidden_layers=3, use_sliding_window=True,
                                          sliding_window=64, max_window_layers=1)) == [64] * 3
    assert sliding_windows(Qwen3MoeConfig(num_hidden_layers=3, sliding_window=64)) == [0] * 3
    config = Qwen3Config(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="layer_types.*chunked_attention"):
        sliding_windows(config)
    model = get_model_class(MistralConfig(architectures=["MistralForCausalLM"]))(
        MistralConfig(num_hidden_layers=2, sliding_window=16, hidden_size=64, intermediate_size=64,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=32),
        max_model_len=16)
    # 16 >= max_model_len
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [0, 0]


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window_mixed"])
def test_sliding_window_on_triton_backend(family_checkpoints, oracle, name):
    """The Triton kernels' windows (interpreted on CPU): prompts past the window, chunks of 40
    across its edge, decode after it, a prefix-cache hit inside it."""
    path = family_checkpoints[name]
    prompts = random_prompts(3, 30, 70, seed=72)
    prompts.append(prompts[0] + [5, 6, 7])
    llm = LLM(path, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=64,
              max_num_batched_tokens=40, attention_backend="triton", device="cpu")
    try:
        windows = [layer.sliding_window for layer in llm.model_runner.attention_layers]
        assert windows == ([24, 24] if name == "mistral_window" else [0, 20])
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outputs = (llm.generate(prompts[:3], sp, use_tqdm=False)
                   + llm.generate(prompts[3:], sp, use_tqdm=False))
        assert llm.scheduler.block_manager.num_cache_hits > 0
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert_matches_oracle(oracle, path, prompts, outputs, 16)


def test_unsupported_rope_type_is_named(tmp_path):
    path = build_tiny_model(str(tmp_path / "longrope"), "llama", head_dim=32,
                            rope_scaling=dict(rope_type="longrope", factor=4.0,
                                              original_max_position_embeddings=256,
                                              short_factor=[1.0] * 16, long_factor=[1.0] * 16))
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        LLM(path, device="cpu", num_kvcache_blocks=16)


LLAMA3 = LLAMA3_ROPE
BAD_ROPE = {  # name: (config.json changes, the field and value the error names)
    "linear_factor_zero": (dict(rope_type="linear", factor=0),
                           r"rope_parameters\['factor'\].*got 0$"),
    "yarn_factor_zero": (dict(rope_type="yarn", factor=0, original_max_position_embeddings=32),
                         r"'factor'.*got 0$"),
    "theta_zero": (dict(rope_theta=0), r"rope_parameters\['rope_theta'\].*got 0$"),
    "theta_negative": (dict(rope_theta=-1.0), r"'rope_theta'.*got -1.0$"),
    "yarn_original_zero": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=0),
                           r"'original_max_position_embeddings'.*got 0$"),
    "factor_string": (dict(rope_type="linear", factor="2"), r"'factor'.*got '2'$"),
    "llama3_low_zero": (dict(LLAMA3, low_freq_factor=0), r"'low_freq_factor'.*got 0$"),
    "llama3_high_not_above_low": (dict(LLAMA3, high_freq_factor=1.0),
                                  r"'high_freq_factor'.*got 1.0 and 1.0$"),
    "llama3_original_zero": (dict(LLAMA3, original_max_position_embeddings=0),
                             r"'original_max_position_embeddings'"),
    "llama3_missing_field": ({k: v for k, v in LLAMA3.items() if k != "low_freq_factor"},
                             r"'low_freq_factor'.*missing"),
    "legacy_rope_scaling": (dict(rope_parameters=None, rope_theta=10000.0,
                                 rope_scaling=dict(type="linear", factor=0)),
                            r"rope_scaling\['factor'\].*got 0$"),
    "legacy_theta": (dict(rope_parameters=None, rope_theta=0), r"the model's rope_theta .*got 0$"),
}


@pytest.mark.parametrize("name", list(BAD_ROPE))
def test_rope_fields_that_make_nan_are_refused_at_load(tiny, tmp_path, name):
    """A rotary field that is zero, negative, not a number or missing (the table would be NaN: token
    0 forever, or a ZeroDivisionError or TypeError) is refused by name when the config is read,
    before any model or worker."""
    from transformers import LlamaConfig

    from nanovllm.config import Config
    changes, message = BAD_ROPE[name]
    if "rope_parameters" not in changes:
        changes = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **changes})
    path = edited_checkpoint(tiny, tmp_path / name, **changes)
    with pytest.raises(ValueError, match=message):
        Config(path, device="cpu")
    with pytest.raises(ValueError, match=message):
        LLM(path, device="cpu", num_kvcache_blocks=16)
    # a config changed after loading is checked when the model is built
    if changes["rope_parameters"] is not None:
        config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1,
                             vocab_size=32)
        config.rope_parameters = changes["rope_parameters"]
        with pytest.raises(ValueError, match=message):
            get_model_class(LlamaConfig(architectures=["LlamaForCausalLM"])).check_config(config,
                                                                                          16)


@pytest.mark.parametrize("yarn", [dict(factor=4.0), dict(factor=8.0, beta_fast=16, beta_slow=2,
                                                          mscale=0.8, mscale_all_dim=0.6),
                                  dict(factor=2.0, attention_factor=1.3)],
                         ids=["defaults", "betas_mscale", "attention_factor"])
def test_qwen3_yarn_matches_transformers(tmp_path, oracle, yarn):
    """Qwen3 with YaRN (its long-context configuration) against transformers, with prompts and
    outputs past the original context: the scaled frequencies and the attention factor applied to
    cos and sin."""
    path = build_tiny_qwen3(str(tmp_path / "yarn"),
                            rope_scaling=dict(rope_type="yarn", original_max_position_embeddings=32,
                                              **yarn))
    prompts = random_prompts(6, 20, 90, seed=71)
    outputs, _ = run_engine(path, prompts,
                            SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                            num_kvcache_blocks=64, device="cpu")
    assert_matches_oracle(oracle, path, prompts, outputs, N)


def test_unsupported_architecture(tiny, tmp_path):
    ckpt = tmp_path / "arch"
    shutil.copytree(tiny, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: .*'LlamaForCausalLM'"
                                         r".*'Qwen3ForCausalLM'"):
        LLM(str(ckpt))


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "llama-3.2-1b", "llama-3.1-8b",
                                    "qwen2.5-7b"])
def test_presets_build_their_architecture(preset):
    """Each preset's config builds (on the meta device: no memory) with the expected parameter
    count."""
    import torch

    from nanovllm.models import get_model_class
    from nanovllm.models.presets import preset_config
    from nanovllm.utils.distributed import tensor_parallel
    config = preset_config(preset)
    with torch.device("meta"), tensor_parallel(0, 1):
        model = get_model_class(config)(config)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    expected = {"qwen3-0.6b": 0.60, "qwen3-8b": 8.19, "llama-3.2-1b": 1.24, "llama-3.1-8b": 8.03,
                "qwen2.5-7b": 7.62}
    assert params == pytest.approx(expected[preset], abs=0.02), params


# ---- models built and loaded directly ------------------------------------------------------------
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    return build_tiny_qwen3(str(tmp_path_factory.mktemp("ckpt") / "sharded"),
                            max_shard_size="100KB")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """Every bias, and a vocabulary that TP=2 does not split evenly (the last rank pads a row)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("ckpt") / "llama"), "llama", head_dim=32,
                            vocab_size=321, attention_bias=True, mlp_bias=True)


def _build(path: str, rank: int = 0, size: int = 1, max_model_len: int | None = None):
    config = AutoConfig.from_pretrained(path)
    with tensor_parallel(rank, size):
        cls = get_model_class(config)
        return cls(config) if max_model_len is None else cls(config, max_model_len)


def _loaded(path, rank: int = 0, size: int = 1):
    model = _build(str(path), rank, size)
    loader.load_model(model, str(path))
    return model


def _assert_same_weights(model, reference):
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_one_rotary_table_of_max_model_len_rows(tiny):
    config = AutoConfig.from_pretrained(tiny)
    model = _build(tiny, max_model_len=100)
    rope = model.model.rotary_emb
    assert all(layer.self_attn.rotary_emb is rope for layer in model.model.layers)
    assert [n for n, _ in model.named_buffers(remove_duplicate=False) if "cos_sin" in n] == \
        ["model.rotary_emb.cos_sin_cache"] + [f"model.layers.{i}.self_attn.rotary_emb.cos_sin_cache"
                                              for i in range(config.num_hidden_layers)]
    assert len({b.data_ptr() for n, b in model.named_buffers(remove_duplicate=False)
                if "cos_sin" in n}) == 1
    # the same rows as a table of max_position_embeddings: the same rotations
    full = get_rope(head_dim_of(config), config.max_position_embeddings, config).cos_sin_cache
    assert rope.cos_sin_cache.shape == (100, head_dim_of(config))
    assert torch.equal(rope.cos_sin_cache, full[:100])
    assert _build(tiny).model.rotary_emb.cos_sin_cache.shape[0] == config.max_position_embeddings


MODELS = {name: REGISTRY.get("model", name) for name in REGISTRY.names("model")}


@pytest.mark.parametrize("cls", list(MODELS.values()), ids=list(MODELS))
@pytest.mark.parametrize("bad", [0, -1, "512", 1.5])
def test_every_family_takes_max_model_len(tiny, cls, bad):
    config = AutoConfig.from_pretrained(tiny)
    assert cls(config, 48).model.layers[1].self_attn.rotary_emb.cos_sin_cache.shape[0] == 48
    with pytest.raises(ValueError,
                       match=f"max_model_len must be a positive int, got {re.escape(repr(bad))}"):
        cls(config, bad)


# ---- checkpoints as they come --------------------------------------------------------------------
def test_index_names_the_files_to_load(sharded, tmp_path):
    """Mistral-7B-v0.3 ships consolidated.safetensors (Mistral's names) beside the indexed HF
    shards."""
    ckpt = _copy(sharded, tmp_path / "mistral_style")
    assert (os.path.exists(os.path.join(ckpt, INDEX))
            and len(glob.glob(os.path.join(ckpt, "*.safetensors"))) > 1)
    save_file({"layers.0.attention.wk.weight": torch.ones(64, 64),
               "tok_embeddings.weight": torch.ones(320, 64)},
              os.path.join(ckpt, "consolidated.safetensors"))
    _assert_same_weights(_loaded(ckpt), _loaded(sharded))


def test_index_naming_a_missing_file_is_refused(sharded, tmp_path):
    ckpt = _copy(sharded, tmp_path / "incomplete")
    shard = sorted(glob.glob(os.path.join(ckpt, "model-*.safetensors")))[-1]
    os.remove(shard)
    with pytest.raises(ValueError, match=re.escape(os.path.basename(shard))):
        _loaded(ckpt)


@pytest.mark.parametrize("index", ["{not json", '{"metadata": {}}',
                                   '{"weight_map": ["model.safetensors"]}'])
def test_unreadable_index_is_named(sharded, tmp_path, index):
    ckpt = _copy(sharded, tmp_path / "bad_index")
    with open(os.path.join(ckpt, INDEX), "w") as f:
        f.write(index)
    with pytest.raises(ValueError,
                       match=re.escape(INDEX) + ".* is not a safetensors index with a weight_map"):
        _loaded(ckpt)


def test_without_index_every_safetensors_file_loads(tiny, tmp_path):
    ckpt = _copy(tiny, tmp_path / "two_files")
    weights = load_file(os.path.join(ckpt, "model.safetensors"))
    os.remove(os.path.join(ckpt, "model.safetensors"))
    names = sorted(weights)
    save_file({n: weights[n] for n in names[::2]}, os.path.join(ckpt, "a.safetensors"))
    save_file({n: weights[n] for n in names[1::2]}, os.path.join(ckpt, "b.safetensors"))
    _assert_same_weights(_loaded(ckpt), _loaded(tiny))


# (tensor, the dim it grows by one): column- and row-parallel weights, packed shards, biases, the
# embedding
BAD_SHAPES = [("model.layers.0.self_attn.q_proj.weight", 0),
              ("model.layers.1.self_attn.k_proj.weight", 0),
              ("model.layers.0.self_attn.v_proj.bias", 0),
              ("model.layers.0.self_attn.o_proj.weight", 1),
              ("model.layers.1.self_attn.o_proj.bias", 0),
              ("model.layers.0.mlp.gate_proj.weight", 0),
              ("model.layers.1.mlp.up_proj.bias", 0), ("model.layers.0.mlp.down_proj.weight", 1),
              ("model.embed_tokens.weight", 0), ("lm_head.weight", 1), ("model.norm.weight", 0)]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name, dim", BAD_SHAPES)
def test_wrong_shape_is_named_under_tensor_parallelism(llama, tmp_path, name, dim, rank):
    """One more row or column splits into a right-looking shard: the whole tensor is checked
    first."""
    ckpt = _copy(llama, tmp_path / "bad")
    weights = load_file(os.path.join(ckpt, "model.safetensors"))
    good = weights[name]
    weights[name] = torch.cat([good, good.narrow(dim, 0, 1)], dim)
    save_file(weights, os.path.join(ckpt, "model.safetensors"))
    message = f"checkpoint tensor '{name}' in model.safetensors: has shape " \
              f"{tuple(weights[name].shape)} but the model expects {tuple(good.shape)}"
    with pytest.raises(ValueError, match=re.escape(message)):
        _loaded(ckpt, rank, 2)


def _rank_part(model, name: str) -> torch.Tensor:
    """The rows of this rank's parameter that came from checkpoint tensor ``name``."""
    for ckpt_name, (packed_name, shard_id) in model.packed_modules_mapping.items():
        if f".{ckpt_name}." in name:
            target = name.replace(ckpt_name, packed_name)
            param = model.get_parameter(target)
            if isinstance(shard_id, int):
                return param.chunk(2)[shard_id]
            qkv = model.get_submodule(target.rsplit(".", 1)[0])
            q, kv = qkv.num_heads * qkv.head_dim, qkv.num_kv_heads * qkv.head_dim
            return param.split([q, kv, kv])["qkv".index(shard_id)]
    return model.get_parameter(name)


def _split_dim(name: str) -> int | None:
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    if name.endswith(("o_proj.bias", "down_proj.bias")) or "norm" in name:
        return None  # replicated
    return 0


def test_tensor_parallel_shards_concatenate_to_the_checkpoint(llama):
    weights = load_file(os.path.join(llama, "model.safetensors"))
    ranks = [_loaded(llama, rank, 2) for rank in (0, 1)]
    for name, tensor in weights.items():
        parts = [_rank_part(model, name) for model in ranks]
        dim = _split_dim(name)
        if dim is None:
            assert all(torch.equal(p, tensor) for p in parts), name
            continue
        whole = torch.cat(parts, dim)
        assert torch.equal(whole.narrow(dim, 0, tensor.size(dim)), tensor), name
        assert not whole.narrow(dim, tensor.size(dim),
                                whole.size(dim) - tensor.size(dim)).any(), name  # padding


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_unreadable_safetensors_file_is_named(sharded, tmp_path, damage):
    ckpt = _copy(sharded, tmp_path / damage)
    file = sorted(glob.glob(os.path.join(ckpt, "model-*.safetensors")))[0]
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write({"truncated": data[:len(data) // 2], "garbage": b"not a checkpoint " * 64,
                 "empty": b""}[damage])
    with pytest.raises(ValueError,
                       match=re.escape(repr(file)) + " is not a readable safetensors file"):
        _loaded(ckpt)


def test_rotary_buffers_of_old_checkpoints_are_skipped(llama, tmp_path):
    ckpt = _copy(llama, tmp_path / "old")
    weights = load_file(os.path.join(ckpt, "model.safetensors"))
    for i in range(2):
        prefix = f"model.layers.{i}.self_attn.rotary_emb."
        weights[prefix + "inv_freq"] = torch.ones(16)
        weights[prefix + "cos_cached"], weights[prefix + "sin_cached"] = \
            torch.ones(1, 1, 1024, 32), torch.zeros(1, 1, 1024, 32)
    save_file(weights, os.path.join(ckpt, "model.safetensors"))
    _assert_same_weights(_loaded(ckpt), _loaded(llama))


def test_missing_weights(tiny, tmp_path):
    ckpt = tmp_path / "noweights"
    shutil.copytree(tiny, ckpt, ignore=shutil.ignore_patterns("*.safetensors*"))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(ckpt))


def test_weights_not_matching_config_name_the_tensor(tiny, tmp_path):
    ckpt = edited_checkpoint(tiny, tmp_path / "shapes", intermediate_size=lambda n: 2 * n)
    with pytest.raises(ValueError, match=r"checkpoint tensor "
                                         r"'model\.layers\.\d\.mlp\.(gate|up|down)_proj\.weight'"):
        LLM(ckpt, device="cpu")


def test_checkpoint_tensor_with_unknown_name_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file
    ckpt = tmp_path / "names"
    shutil.copytree(tiny, ckpt)
    weights = load_file(str(ckpt / "model.safetensors"))
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(weights, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError,
                       match="'model.layers.0.mlp.extra_proj.weight'.*matches no parameter"):
        LLM(str(ckpt), device="cpu")


@pytest.mark.parametrize("keep", ["nothing", "tokenizer_config.json"])
def test_directory_without_tokenizer_files_is_refused(tiny, tmp_path, keep):
    ckpt = tmp_path / "no_tokenizer"
    shutil.copytree(tiny, ckpt,
                    ignore=lambda _, names: [n for n in names if "token" in n and n != keep])
    with pytest.raises(ValueError, match=re.escape(f"{str(ckpt)!r} has no tokenizer files") +
                       ".*pass tokenizer=<dir> or skip_tokenizer_init=True to run on token ids"):
        loader.load_tokenizer(str(ckpt))
    assert len(loader.load_tokenizer(tiny)) == 259


def test_tokenizer_loads_with_garbage_collection_paused(tiny, monkeypatch):
    """load_tokenizer pauses the cyclic collector and leaves it as it found it, also when loading
    fails."""
    import gc

    from transformers import AutoTokenizer
    seen = []

    def from_pretrained(path):
        seen.append(gc.isenabled())
        if len(seen) % 2 == 0:
            raise OSError("unreadable")
        return [0, 1]

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    try:
        for enabled in (True, True, False, False):
            gc.enable() if enabled else gc.disable()
            with contextlib.suppress(OSError):
                assert loader.load_tokenizer(tiny) == [0, 1]
            assert gc.isenabled() is enabled
    finally:
        gc.enable()
    assert seen == [False] * 4


def test_tokenizer_of_one_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))) \
        .save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="has 1 token.*skip_tokenizer_init=True"):
        loader.load_tokenizer(str(tmp_path))
