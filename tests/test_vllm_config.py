"""vLLM's engine keywords and value conventions: keywords that change nothing here are accepted and named in
one log line, those that would change behaviour are refused by name; dtype aliases, seed and None conventions; model
names as users type them (Hugging Face Hub ids, resolved from a local cache laid out in tmp_path, never the network)."""
from __future__ import annotations

import gc
import logging
import shutil

import huggingface_hub
import pytest
import torch
from conftest import CPU_ENGINE, ENGINE, GREEDY, token_ids_of
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPTS = ["Hello, Nano-vLLM.", [1, 2, 3, 4, 5]]


# ---- keywords ------------------------------------------------------------------------------------
def test_ignored_keywords_are_logged_once_and_the_engine_runs(tiny, llm, caplog):
    caplog.set_level(logging.INFO, logger="nanovllm")
    ignored = dict(trust_remote_code=True, swap_space=4, disable_log_stats=True, compilation_config={"level": 3},
                   max_seq_len_to_capture=8192, enable_chunked_prefill=True, quantization=None, cpu_offload_gb=0)
    engine = LLM(tiny, **ENGINE, **ignored)
    try:
        assert token_ids_of(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == \
            token_ids_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        engine.exit()
    lines = [r for r in caplog.records if "ignored vLLM engine argument" in r.getMessage()]
    assert len(lines) == 1 and lines[0].name == "nanovllm"
    assert all(f"{name} (" in lines[0].getMessage() for name in ignored)


@pytest.mark.parametrize("kwargs, match", [
    (dict(quantization="awq"), "quantization='awq'"),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
    (dict(speculative_config={"method": "ngram"}), "speculative_config="),
    (dict(enable_lora=True), "enable_lora=True"),
    (dict(max_lora_rank=16), "max_lora_rank=16"),
    (dict(cpu_offload_gb=4), "cpu_offload_gb=4"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype.*'fp8_e5m2'"),
    (dict(enable_chunked_prefill=False), "enable_chunked_prefill=False"),
    (dict(load_format="gguf"), "load_format.*'gguf'"),
    (dict(guided_decoding_backend="outlines"), "guided_decoding_backend='outlines'.*xgrammar"),
    (dict(structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True}),
     "structured_outputs_config=.*per request"),
])
def test_unsupported_keywords_are_refused_by_name(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny, **kwargs)


def test_structured_output_backend_xgrammar_is_accepted(tiny):
    """vLLM's backend choice at the value nanovllm uses (xgrammar, or auto) changes nothing: accepted."""
    config = Config.from_kwargs(tiny, device="cpu", guided_decoding_backend="xgrammar",
                                structured_outputs_config={"backend": "auto"})
    assert config.model == tiny


def test_unknown_keyword_is_still_a_type_error(tiny):
    with pytest.raises(TypeError, match="'swap_spaces'"):
        LLM(tiny, swap_spaces=4)


# ---- values --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, expected", [
    ("auto", torch.float32), ("half", torch.float16), ("float16", torch.float16), ("bfloat16", torch.bfloat16),
    ("float", torch.float32), ("float32", torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
])
def test_dtype_aliases(tiny, dtype, expected):
    assert Config.from_kwargs(tiny, dtype=dtype, device="cpu").torch_dtype == expected


def test_dtype_alias_in_a_running_engine(tiny):
    engine = LLM(tiny, **ENGINE, device="cpu", dtype="half")
    try:
        assert engine.config.torch_dtype == torch.float16
        assert len(engine.generate(["a"], GREEDY, use_tqdm=False)[0]["token_ids"]) == 8
    finally:
        engine.exit()


def test_seed_none_is_vllms_default_zero(tiny):
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = {}
    for seed in (None, 0, 1):
        engine = LLM(tiny, **ENGINE, seed=seed)
        try:
            runs[seed] = token_ids_of(engine.generate(PROMPTS, sampled, use_tqdm=False))
            assert engine.config.seed == (seed or 0)
        finally:
            engine.exit()
    assert runs[None] == runs[0] != runs[1]
    for bad in (-1, 2 ** 32):  # outside vLLM's range (numpy's seeds)
        with pytest.raises(ValueError, match="seed"):
            Config.from_kwargs(tiny, seed=bad)


def test_none_and_minus_one_conventions(tiny):
    for auto in (None, -1):  # the model's length
        assert Config.from_kwargs(tiny, max_model_len=auto).max_model_len == 1024
    config = Config.from_kwargs(tiny, max_num_seqs=None, max_num_batched_tokens=None, block_size=None,
                                num_gpu_blocks_override=None, enable_prefix_caching=None)
    default = Config(tiny)
    for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "num_kvcache_blocks",
                 "enable_prefix_caching"):
        assert getattr(config, name) == getattr(default, name), name
    assert Config.from_kwargs(tiny, num_gpu_blocks_override=64).num_kvcache_blocks == 64


# ---- Hugging Face Hub ids ------------------------------------------------------------------------
def add_snapshot(cache, repo_id: str, checkpoint: str, ref: str = "main") -> str:
    """Lays out ``checkpoint`` in Hugging Face's cache layout: models--org--name/{refs/<ref>, snapshots/<commit>/}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(checkpoint, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(COMMIT)
    return str(repo / "snapshots" / COMMIT)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline. huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when it is
    imported, so its constants are set as well as the environment."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolves_to_its_cached_snapshot(tiny, llm, hub_cache):
    snapshot = add_snapshot(hub_cache, "org/name", tiny)
    engine = LLM("org/name", **ENGINE)
    try:
        assert engine.config.model == snapshot and engine.tokenizer is not None
        assert token_ids_of(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == \
            token_ids_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        engine.exit()
    assert Config.from_kwargs("org/name", revision=COMMIT).model == snapshot
    assert Config.from_kwargs(tiny, tokenizer="org/name").tokenizer == snapshot


def test_hub_id_missing_from_the_cache(tiny, hub_cache):
    with pytest.raises(ValueError, match=r"'org/missing'.*not in the local cache.*HF_HUB_OFFLINE.*"
                                         r"`hf download org/missing`"):
        LLM("org/missing")
    add_snapshot(hub_cache, "org/name", tiny)
    with pytest.raises(ValueError, match=r"revision 'v2'.*`hf download org/name --revision v2`"):
        LLM("org/name", revision="v2")
    no_weights = shutil.copytree(tiny, hub_cache.parent / "noweights", ignore=shutil.ignore_patterns("*.safetensors"))
    add_snapshot(hub_cache, "org/noweights", no_weights)
    with pytest.raises(ValueError, match=r"'org/noweights'.*without \*\.safetensors"):
        LLM("org/noweights")


def test_hub_id_downloads_only_after_the_cache_and_when_online(tiny, hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def snapshot_download(repo_id, local_files_only=False, **kwargs):  # the Hub, without the network
        calls.append((repo_id, local_files_only, kwargs["revision"]))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        return add_snapshot(hub_cache, repo_id, tiny)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    config = Config.from_kwargs("org/name", revision="main")
    assert config.model == str(hub_cache / "models--org--name" / "snapshots" / COMMIT)
    assert calls == [("org/name", True, "main"), ("org/name", False, "main")]


# ---- vLLM's command-line flags and module paths ----------------------------------------------------
def test_flexible_argument_parser_flags_reach_the_engine_through_llm_of_vars_args(tiny):
    """vLLM's examples pass every flag of ``EngineArgs.add_cli_args`` to ``LLM(**vars(args))``: the flags left
    unset (None, both names of an alias pair among them) are defaults; underscores spell dashed flags."""
    from nanovllm import EngineArgs
    from nanovllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = vars(parser.parse_args([f"--model={tiny}", "--max_model_len", "256", "--block-size", "16",
                                   "--num_gpu_blocks_override=64", "--device", "cpu"]))
    assert args["kvcache_block_size"] is None and args["block_size"] == 16
    engine = LLM(**args)
    try:
        c = engine.config
        assert (c.max_model_len, c.kvcache_block_size, c.num_kvcache_blocks) == (256, 16, 64)
        assert (c.max_num_seqs, c.gpu_memory_utilization, c.dtype) == (Config(tiny).max_num_seqs, 0.9, "auto")
        assert len(engine.generate(["a"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    finally:
        engine.exit()
    with pytest.raises(TypeError, match="pass kvcache_block_size or its alias block_size, not both"):
        Config.from_kwargs(tiny, kvcache_block_size=16, block_size=32)


def test_beam_search_params_has_vllms_module_path():
    from nanovllm.beam_search import BeamSearchParams as FromBeamSearch
    from nanovllm.sampling_params import BeamSearchParams
    assert BeamSearchParams is FromBeamSearch
    assert BeamSearchParams(beam_width=2, max_tokens=4).length_penalty == 1.0


def test_cleanup_dist_env_and_memory_frees_dropped_engines_and_keeps_live_ones(tiny):
    from nanovllm.distributed import cleanup_dist_env_and_memory
    live = LLM(tiny, **CPU_ENGINE)
    gc.disable()  # the collection is cleanup's to make
    try:
        dropped = LLM(tiny, **CPU_ENGINE)
        dropped.itself, resources = dropped, dropped._resources  # a cycle: only a collection frees it
        before = token_ids_of(live.generate(PROMPTS, GREEDY, use_tqdm=False))
        del dropped
        assert not resources.closed
        cleanup_dist_env_and_memory()
        assert resources.closed
        cleanup_dist_env_and_memory(shutdown_ray=False)
        assert token_ids_of(live.generate(PROMPTS, GREEDY, use_tqdm=False)) == before
    finally:
        gc.enable()
        live.exit()
