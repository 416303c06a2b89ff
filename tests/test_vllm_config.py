"""vLLM's engine keywords and value conventions: keywords that change nothing here are accepted and
named in one log line, those that would change behaviour are refused by name; dtype aliases, seed
and None conventions; model names as users type them (Hugging Face Hub ids, resolved from a local
cache laid out in tmp_path, never the network)."""
from __future__ import annotations

import dataclasses
import gc
import gzip
import json
import logging
import shutil
import time

import huggingface_hub
import pytest
import torch
from conftest import CPU_ENGINE, ENGINE, GREEDY, token_ids_of
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError

from nanovllm import LLM, RequestOutput, SamplingParams
from nanovllm.config import Config
from nanovllm.entrypoints.llm import create_engine_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPTS = ["Hello, Nano-vLLM.", [1, 2, 3, 4, 5]]


# ---- keywords ------------------------------------------------------------------------------------
def test_ignored_keywords_are_logged_once_and_the_engine_runs(tiny, llm, caplog):
    caplog.set_level(logging.INFO, logger="nanovllm")
    # (disable_log_stats is not among them: False installs get_metrics()'s statistics)
    ignored = dict(trust_remote_code=True, swap_space=4, compilation_config={"level": 3},
                   max_seq_len_to_capture=8192, cpu_offload_gb=0)
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
    (dict(speculative_config={"method": "ngram"}), "speculative_config needs num_speculative"),
    (dict(speculative_config={"method": "eagle", "model": "x", "num_speculative_tokens": 2}),
     "speculative_config method='eagle'"),
    (dict(enable_lora=True), "enable_lora=True"),
    (dict(max_lora_rank=16), "max_lora_rank=16"),
    (dict(cpu_offload_gb=4), "cpu_offload_gb=4"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype.*'fp8_e5m2'"),
    (dict(load_format="gguf"), "load_format.*'gguf'"),
    (dict(guided_decoding_backend="outlines"), "guided_decoding_backend='outlines'.*xgrammar"),
    (dict(structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True}),
     "structured_outputs_config=.*per request"),
])
def test_unsupported_keywords_are_refused_by_name(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny, **kwargs)


def test_structured_output_backend_xgrammar_is_accepted(tiny):
    """vLLM's backend choice at the value nanovllm uses (xgrammar, or auto) changes nothing:
    accepted."""
    config = create_engine_config(tiny, device="cpu", guided_decoding_backend="xgrammar",
                                structured_outputs_config={"backend": "auto"})
    assert config.model == tiny


def test_unknown_keyword_is_still_a_type_error(tiny):
    with pytest.raises(TypeError, match="'swap_spaces'"):
        LLM(tiny, swap_spaces=4)


# ---- values --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, expected", [
    ("auto", torch.float32), ("half", torch.float16), ("float16", torch.float16),
    ("bfloat16", torch.bfloat16),
    ("float", torch.float32), ("float32", torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
])
def test_dtype_aliases(tiny, dtype, expected):
    assert create_engine_config(tiny, dtype=dtype, device="cpu").torch_dtype == expected


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
            create_engine_config(tiny, seed=bad)


def test_none_and_minus_one_conventions(tiny):
    for auto in (None, -1):  # the model's length
        assert create_engine_config(tiny, max_model_len=auto).max_model_len == 1024
    config = create_engine_config(tiny, max_num_seqs=None, max_num_batched_tokens=None,
                                  block_size=None, num_gpu_blocks_override=None,
                                  enable_prefix_caching=None)
    default = Config(tiny)
    for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size",
                 "num_kvcache_blocks", "enable_prefix_caching"):
        assert getattr(config, name) == getattr(default, name), name
    assert create_engine_config(tiny, num_gpu_blocks_override=64).num_kvcache_blocks == 64


# ---- Hugging Face Hub ids ------------------------------------------------------------------------
def add_snapshot(cache, repo_id: str, checkpoint: str, ref: str = "main") -> str:
    """Lays out ``checkpoint`` in Hugging Face's cache layout: models--org--name/{refs/<ref>,
    snapshots/<commit>/}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(checkpoint, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(COMMIT)
    return str(repo / "snapshots" / COMMIT)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline. huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE
    when it is imported, so its constants are set as well as the environment."""
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
    assert create_engine_config("org/name", revision=COMMIT).model == snapshot
    assert create_engine_config(tiny, tokenizer="org/name").tokenizer == snapshot


def test_hub_id_missing_from_the_cache(tiny, hub_cache):
    with pytest.raises(ValueError, match=r"'org/missing'.*not in the local cache.*HF_HUB_OFFLINE.*"
                                         r"`hf download org/missing`"):
        LLM("org/missing")
    add_snapshot(hub_cache, "org/name", tiny)
    with pytest.raises(ValueError, match=r"revision 'v2'.*`hf download org/name --revision v2`"):
        LLM("org/name", revision="v2")
    no_weights = shutil.copytree(tiny, hub_cache.parent / "noweights",
                                 ignore=shutil.ignore_patterns("*.safetensors"))
    add_snapshot(hub_cache, "org/noweights", no_weights)
    with pytest.raises(ValueError, match=r"'org/noweights'.*without \*\.safetensors"):
        LLM("org/noweights")


def test_hub_id_downloads_only_after_the_cache_and_when_online(tiny, hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    # the Hub, without the network
    def snapshot_download(repo_id, local_files_only=False, **kwargs):
        calls.append((repo_id, local_files_only, kwargs["revision"]))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        return add_snapshot(hub_cache, repo_id, tiny)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    config = create_engine_config("org/name", revision="main")
    assert config.model == str(hub_cache / "models--org--name" / "snapshots" / COMMIT)
    assert calls == [("org/name", True, "main"), ("org/name", False, "main")]


# ---- vLLM's command-line flags and module paths --------------------------------------------------
def test_flexible_argument_parser_flags_reach_the_engine_through_llm_of_vars_args(tiny):
    """vLLM's examples pass every flag of ``EngineArgs.add_cli_args`` to ``LLM(**vars(args))``: the
    flags left unset (None, both names of an alias pair among them) are defaults; underscores spell
    dashed flags."""
    from nanovllm import EngineArgs
    from nanovllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = vars(parser.parse_args([f"--model={tiny}", "--max_model_len", "256", "--block-size",
                                   "16", "--num_gpu_blocks_override=64", "--device", "cpu"]))
    assert args["kvcache_block_size"] is None and args["block_size"] == 16
    engine = LLM(**args)
    try:
        c = engine.config
        assert (c.max_model_len, c.kvcache_block_size, c.num_kvcache_blocks) == (256, 16, 64)
        assert (c.max_num_seqs, c.gpu_memory_utilization, c.dtype) == (Config(tiny).max_num_seqs,
                                                                        0.9, "auto")
        assert len(engine.generate(["a"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    finally:
        engine.exit()
    with pytest.raises(TypeError,
                       match="pass kvcache_block_size or its alias block_size, not both"):
        create_engine_config(tiny, kvcache_block_size=16, block_size=32)


def test_beam_search_params_has_vllms_module_path():
    from nanovllm.features.beam_search import BeamSearchParams as FromBeamSearch
    from nanovllm.sampling_params import BeamSearchParams
    assert BeamSearchParams is FromBeamSearch
    assert BeamSearchParams(beam_width=2, max_tokens=4).length_penalty == 1.0


def test_cleanup_dist_env_and_memory_frees_dropped_engines_and_keeps_live_ones(tiny):
    from nanovllm.distributed import cleanup_dist_env_and_memory
    live = LLM(tiny, **CPU_ENGINE)
    gc.disable()  # the collection is cleanup's to make
    try:
        dropped = LLM(tiny, **CPU_ENGINE)
        # a cycle: only a collection frees it
        dropped.itself, resources = dropped, dropped._resources
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


# ---- vLLM's LLM methods and engine keywords ------------------------------------------------------
def rank_and_scaled_blocks(runner, scale, offset=0):
    return runner.rank, runner.num_kvcache_blocks * scale + offset


def all_reduce_ranks(runner):
    """A collective: it returns only if every rank runs it at once."""
    t = torch.tensor([float(runner.rank + 1)])
    return runner.group.all_reduce(t).item() if runner.group is not None else t.item()


def fails_on_rank_1(runner):
    if runner.rank == 1:
        raise ValueError("rank 1 refuses")
    return runner.rank


def sleeps_on_rank_1(runner, seconds):
    time.sleep(seconds if runner.rank == 1 else 0)


def trace_ranks(directory) -> list[str]:
    """The ranks of the torch profiler traces in ``directory``, each checked to be a Chrome
    trace."""
    ranks = []
    for path in sorted(directory.iterdir()):
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
            assert "traceEvents" in json.load(f), path
        ranks.append(path.name.split(".")[0])
    return ranks


def test_collective_rpc_and_the_profiler_on_one_rank(tiny, llm, tmp_path):
    engine = LLM(tiny, **CPU_ENGINE,
                 profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    try:
        blocks = engine.config.num_kvcache_blocks
        assert engine.collective_rpc(rank_and_scaled_blocks, args=(2,), kwargs={"offset": 1}) \
            == [(0, 2 * blocks + 1)]
        # in this process: any callable
        assert engine.collective_rpc(lambda runner: runner.rank) == [0]
        assert engine.collective_rpc("_block_bytes") == [engine.model_runner._block_bytes()]
        with pytest.raises(ValueError, match="method='no_such_method'"):
            engine.collective_rpc("no_such_method")
        engine.start_profile()
        with pytest.raises(RuntimeError, match="running already"):
            engine.start_profile()
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        engine.stop_profile()
        assert trace_ranks(tmp_path) == ["rank0"] \
            and next(tmp_path.iterdir()).name.endswith(".pt.trace.json.gz")
        with pytest.raises(RuntimeError, match="stop_profile"):
            engine.stop_profile()
    finally:
        engine.exit()
    with pytest.raises(RuntimeError, match="profiler_config"):
        llm.start_profile()


def max_positions(runner):
    return runner.config.hf_config.max_position_embeddings


def float8_sum(runner, tensor):  # float8 tensors cross the call channel (as bytes) both ways
    return float(tensor.float().sum()), tensor


def test_collective_rpc_and_the_profiler_on_two_ranks(tiny, tmp_path):
    profile = {"profiler": "torch", "torch_profiler_dir": str(tmp_path),
               "torch_profiler_use_gzip": False}

    def extend(hf_config):  # a local function: the workers get the config it made, not the function
        hf_config.max_position_embeddings = 2048
        return hf_config
    engine = LLM(tiny, **CPU_ENGINE, tensor_parallel_size=2, profiler_config=profile,
                 hf_overrides=extend)
    try:
        assert engine.collective_rpc(max_positions) == [2048, 2048]
        blocks = engine.config.num_kvcache_blocks
        assert engine.collective_rpc(rank_and_scaled_blocks, args=(2,), kwargs={"offset": 1}) == \
            [(0, 2 * blocks + 1), (1, 2 * blocks + 1)]
        assert engine.collective_rpc(all_reduce_ranks) == [3.0, 3.0]
        fp8 = torch.tensor([0.5, 1.5, -2.0, 448.0]).to(torch.float8_e4m3fn)
        for total, back in engine.collective_rpc(float8_sum, args=(fp8,)):
            assert total == 448.0 and back.dtype == fp8.dtype and torch.equal(back.float(),
                                                                               fp8.float())
        with pytest.raises(RuntimeError, match="rank 1 raised ValueError: rank 1 refuses"):
            engine.collective_rpc(fails_on_rank_1)
        with pytest.raises(TypeError, match="pickle"):
            engine.collective_rpc(lambda runner: runner.rank)
        assert engine.collective_rpc("_block_bytes", timeout=60) \
            == [engine.model_runner._block_bytes()] * 2
        engine.start_profile(profile_prefix="tp")
        assert len(engine.generate(PROMPTS, GREEDY, use_tqdm=False)[1].outputs[0].token_ids) == 8
        engine.stop_profile()
        assert trace_ranks(tmp_path) == ["tp_rank0", "tp_rank1"]
        # its reply would come late: the engine shuts down
        with pytest.raises(TimeoutError, match="rank 1"):
            engine.collective_rpc(sleeps_on_rank_1, timeout=0.5, args=(60,))
        with pytest.raises(RuntimeError, match="shut down"):
            engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        engine.exit()


def test_vllms_profiler_config_class_from_vllms_module_path(tiny, tmp_path):
    """vLLM's run_one_batch.py: ``from vllm.config import ProfilerConfig``, passed to ``LLM``."""
    from nanovllm.config import ProfilerConfig
    from nanovllm.entrypoints.arg_utils import _PROFILER_FLAGS
    assert {name: default for name, (_, default) in _PROFILER_FLAGS.items()} == {
        f.name: f.default for f in dataclasses.fields(ProfilerConfig)
        if f.name.startswith("torch_profiler_") and f.name != "torch_profiler_dir"}
    config = ProfilerConfig(profiler="torch", torch_profiler_dir=str(tmp_path),
                            torch_profiler_use_gzip=False)
    engine = LLM(tiny, **CPU_ENGINE, profiler_config=config)
    try:
        engine.start_profile()
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        engine.stop_profile()
        assert trace_ranks(tmp_path) == ["rank0"] \
            and next(tmp_path.iterdir()).name.endswith(".pt.trace.json")
    finally:
        engine.exit()
    assert create_engine_config(tiny, profiler_config=ProfilerConfig()).model  # None: no profiler
    with pytest.raises(TypeError, match="delay_iterations"):  # a field nanovllm does not have
        ProfilerConfig(profiler="torch", torch_profiler_dir="traces", delay_iterations=2)

@pytest.mark.parametrize("profiler_config, error, match", [
    ({"profiler": "cuda"}, ValueError, "profiler='cuda'"),
    ({"profiler": "torch"}, ValueError, "torch_profiler_dir must be set when profiler is 'torch'"),
    ({"torch_profiler_dir": "traces"}, ValueError, "torch_profiler_dir is only applicable"),
    ({"profiler": "torch", "torch_profiler_dir": "traces", "delay_iterations": 2}, ValueError,
     "delay_iterations"),
    ({"profiler": "torch", "torch_profiler_dir": "traces", "torch_profiler_with_stack": "no"},
     TypeError, "torch_profiler_with_stack"),
    ("torch", TypeError, "profiler_config must be a dict or a ProfilerConfig"),
])
def test_profiler_config_is_checked_by_name(tiny, profiler_config, error, match):
    with pytest.raises(error, match=match):
        create_engine_config(tiny, profiler_config=profiler_config)


def metric_values(engine) -> dict:
    return {(m.name, m.labels.get("finished_reason")): m.value for m in engine.get_metrics()}


def test_get_metrics_counts_requests_tokens_preemptions_and_the_prefix_cache(tiny):
    from nanovllm.v1.metrics.reader import Counter, Gauge, Histogram, Metric, Vector
    assert all(issubclass(t, Metric) for t in (Counter, Gauge, Histogram, Vector))
    with LLM(tiny, device="cpu") as plain, pytest.raises(ValueError,
                                                         match="disable_log_stats=False"):
        plain.get_metrics()  # as in vLLM, the statistics are off by default
    engine = LLM(tiny, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=12,
                 device="cpu", disable_log_stats=False)
    prompt = list(range(1, 41))  # two full blocks the prefix cache can share
    try:
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
        # 4 x 5 blocks in 12: preemptions
        engine.generate([prompt, prompt[::-1]], sp, use_tqdm=False)
        engine.add_request("live", prompt,
                           SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        engine.step()
        live = metric_values(engine)
        assert live[("vllm:num_requests_running", None)] == 1 \
            and live[("vllm:num_requests_waiting", None)] == 0
        assert live[("vllm:kv_cache_usage_perc", None)] == 3 / 12
        assert live[("vllm:generation_tokens", None)] == 4 * 40 + 1
        engine.add_request("aborted", prompt, SamplingParams(max_tokens=3))
        engine.abort_request("aborted")
        while engine.has_unfinished_requests():
            engine.step()
        values = metric_values(engine)
        assert values[("vllm:num_requests_running", None)] == 0 \
            and values[("vllm:kv_cache_usage_perc", None)] == 0
        assert values[("vllm:generation_tokens", None)] == 4 * 40 + 3
        assert values[("vllm:prompt_tokens", None)] == 5 * 40  # the aborted request never prefilled
        assert values[("vllm:num_preemptions", None)] == engine.scheduler.num_preemptions > 0
        assert values[("vllm:prefix_cache_queries", None)] == 5 * 40
        # siblings, and the prompt again
        assert 3 * 32 <= values[("vllm:prefix_cache_hits", None)] <= 5 * 32
        assert values[("vllm:request_success", "length")] == 5 \
            and values[("vllm:request_success", "abort")] == 1
        assert values[("vllm:request_success", "stop")] \
            == values[("vllm:request_success", "error")] == 0
    finally:
        engine.exit()


def test_reset_prefix_cache_with_running_requests_preempts_them_first(tiny, llm):
    prompt, sp = list(range(1, 41)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    # a step in flight when the cache is reset
    engine = LLM(tiny, **CPU_ENGINE, async_scheduling=True)
    try:
        engine.generate([prompt], sp, use_tqdm=False)
        engine.add_request("r", prompt, sp)
        engine.step()
        engine.step()
        # vLLM's default: refused while requests hold blocks
        assert engine.reset_prefix_cache() is False
        assert engine.reset_prefix_cache(reset_running_requests=True) is True
        blocks = engine.scheduler.block_manager
        assert not blocks.hash_to_block_id and not blocks.used_block_ids \
            and engine.scheduler.num_preemptions == 1
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected
        with pytest.raises(TypeError, match="reset_running_requests"):
            engine.reset_prefix_cache(reset_running_requests="yes")
    finally:
        engine.exit()


def test_hf_overrides_extend_the_context_as_config_json_would(tiny, llm, tmp_path):
    """vLLM's context extension: a rope dict without ``rope_theta`` keeps config.json's."""
    overrides = {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                 "max_position_embeddings": 2048}
    edited = shutil.copytree(tiny, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (edited / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=2048)))
    assert create_engine_config(tiny, max_model_len=None,
                                hf_overrides=overrides).max_model_len == 2048
    runs = []
    for path, kwargs in ((tiny, dict(hf_overrides=overrides)), (str(edited), {})):
        engine = LLM(path, **ENGINE, **kwargs)
        try:
            assert engine.config.hf_config.rope_parameters == config["rope_parameters"]
            runs.append(token_ids_of(engine.generate(PROMPTS, GREEDY, use_tqdm=False)))
        finally:
            engine.exit()
    assert runs[0] == runs[1] != token_ids_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False))

    def extend(hf_config):
        hf_config.max_position_embeddings = 4096
        return hf_config
    assert create_engine_config(tiny, max_model_len=None, hf_overrides=extend).max_model_len == 4096
    with pytest.raises(TypeError, match="hf_overrides must be a dict or a callable"):
        create_engine_config(tiny, hf_overrides=[("max_position_embeddings", 2048)])
    with pytest.raises(TypeError, match="hf_overrides must return the model's config"):
        create_engine_config(tiny, hf_overrides=lambda hf_config: None)


def test_enable_chunked_prefill_false_runs_unchunked_or_is_refused_by_name(tiny, llm):
    """This engine splits a prompt only when it exceeds max_num_batched_tokens: False holds while
    that covers max_model_len, and gives the same outputs."""
    engine = LLM(tiny, **ENGINE, enable_chunked_prefill=False)
    try:
        assert token_ids_of(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == \
            token_ids_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        engine.exit()
    with pytest.raises(ValueError, match=r"enable_chunked_prefill=False needs "
                                         r"max_num_batched_tokens \(64\) >= max_model_len \(512\)"):
        create_engine_config(tiny, enable_chunked_prefill=False, max_num_batched_tokens=64,
                             max_model_len=512)
    with pytest.raises(TypeError, match="enable_chunked_prefill"):
        create_engine_config(tiny, enable_chunked_prefill="no")


def test_request_output_ignores_keywords_of_a_later_vllm(caplog):
    caplog.set_level(logging.WARNING, logger="nanovllm")
    output = RequestOutput(request_id="test_request_id", prompt="test prompt",
                           prompt_token_ids=[1, 2, 3], prompt_logprobs=None, outputs=[],
                           finished=False, example_arg_added_in_new_version="some_value")
    assert output.request_id == "test_request_id" and output.prompt_token_ids == [1, 2, 3]
    assert not hasattr(output, "example_arg_added_in_new_version")
    assert "example_arg_added_in_new_version" in caplog.text
    with pytest.raises(TypeError):  # a field it needs is still needed
        RequestOutput(request_id="x", example_arg_added_in_new_version=1)


def test_vllms_short_flags_and_a_list_of_logits_processors_parse():
    from nanovllm import EngineArgs
    from nanovllm.utils.argparse_utils import FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["-tp", "2", "-q", "fp8", "--logits-processors", "m.A", "m:B",
                              "--max_model_len=64"])
    assert EngineArgs.from_cli_args(args).kwargs == {
        "tensor_parallel_size": 2, "quantization": "fp8", "logits_processors": ["m.A", "m:B"],
        "max_model_len": 64}


def test_exit_while_the_profiler_runs_stops_it_and_writes_the_trace(tiny, tmp_path):
    """exit() (or dropping the engine) with the profiler running used to leave torch's profiler
    recording every later engine's work, and no trace was written."""
    import torch
    engine = LLM(tiny, **CPU_ENGINE,
                 profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    engine.start_profile()
    engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert torch.autograd.profiler._is_profiler_enabled
    engine.exit()
    assert not torch.autograd.profiler._is_profiler_enabled
    assert trace_ranks(tmp_path) == ["rank0"]


def test_hf_overrides_of_rope_theta_and_the_layer_count_reach_the_model(tiny, tmp_path):
    """rope_theta alone used to be dropped (config.json's theta won); num_hidden_layers left
    layer_types at the old count (a misleading error): derived fields now follow the override."""
    edited = shutil.copytree(tiny, tmp_path / "theta")
    config = json.loads((edited / "config.json").read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_theta": 500.0}
    (edited / "config.json").write_text(json.dumps(config))
    with LLM(str(edited), **ENGINE) as from_file, \
            LLM(tiny, **ENGINE, hf_overrides={"rope_theta": 500.0}) as overridden:
        assert overridden.config.hf_config.rope_parameters["rope_theta"] == 500.0
        cache = [e.model_runner.model.model.rotary_emb.cos_sin_cache
                 for e in (from_file, overridden)]
        assert torch.equal(*cache)
        assert token_ids_of(overridden.generate(PROMPTS, GREEDY, use_tqdm=False)) == \
            token_ids_of(from_file.generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(tiny, **ENGINE, load_format="dummy", hf_overrides={"num_hidden_layers": 1}) as one:
        assert len(one.model_runner.model.model.layers) == 1
        assert len(getattr(one.config.hf_config, "layer_types", None) or [0]) == 1


def test_weights_loaded_after_start_through_vllms_worker_methods():
    """vLLM's skip_loading_weights_in_engine_init.py: start with load_format="dummy", then
    collective_rpc("update_config", ...) and collective_rpc("reload_weights") load the checkpoint
    (the RL trainers' pattern); other overrides are refused by name."""
    sp = SamplingParams(temperature=0, max_tokens=12)
    with LLM("nanovllm:demo", device="cpu") as real:
        expected = token_ids_of(real.generate(["def add(a, b):"], sp, use_tqdm=False))
    with LLM("nanovllm:demo", device="cpu", load_format="dummy") as llm:
        assert token_ids_of(llm.generate(["def add(a, b):"], sp, use_tqdm=False)) != expected
        llm.collective_rpc("update_config", args=({"load_config": {"load_format": "auto"}},))
        llm.collective_rpc("reload_weights")
        assert token_ids_of(llm.generate(["def add(a, b):"], sp, use_tqdm=False)) == expected
        with pytest.raises(ValueError, match="update_config takes"):
            llm.collective_rpc("update_config", args=({"model_config": {}},))
