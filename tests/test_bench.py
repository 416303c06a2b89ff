"""bench.py: nano-vllm's workload, the roofline arithmetic, and a small run end to end on CPU."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench  # noqa: E402
from nanovllm.models.presets import preset_config  # noqa: E402


def test_workload_is_nano_vllms():
    prompts, params = bench.workload()
    assert len(prompts) == 256
    assert sum(sp.max_tokens for sp in params) == 133_966
    assert sum(len(p) for p in prompts) == 142_827
    assert all(100 <= len(p) <= 1024 and 100 <= sp.max_tokens <= 1024
               for p, sp in zip(prompts, params))
    assert all(sp.temperature == 0.6 and sp.ignore_eos for sp in params)


def test_roofline_matches_the_reference_arithmetic():
    """The workload's roofline worked out by hand at 4254 GB/s and 772 TFLOP/s: 3.55 s of memory,
    0.42 s of compute, 37,767 tok/s with perfect overlap."""
    prompts, params = bench.workload()
    limit = bench.roofline(preset_config("qwen3-0.6b"), [len(p) for p in prompts],
                           [sp.max_tokens for sp in params], 4254e9, 772e12)
    assert limit.output_tokens == 133_966
    assert limit.seconds_memory == pytest.approx(3.547, abs=0.005)
    assert limit.seconds_compute == pytest.approx(0.42, abs=0.005)
    assert round(limit.tok_per_s) == 37_767



def test_roofline_counts_fp8_weights_bytes_and_their_matmul_rate():
    """fp8 projections are read at 1 byte and their scales' share; the embeddings and the LM head
    stay bf16; their FLOPs run at the fp8 rate. Qwen3-8B at batch 1, 1,023 decode steps: bf16 reads
    8.19e9 parameters a step (6.95e9 of them projections)."""
    config = preset_config("qwen3-8b")
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    attn = h * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim \
        + config.num_attention_heads * config.head_dim * h
    projections = layers * (attn + 3 * h * inter)
    other = 2 * config.vocab_size * h
    args = ([512], [1024], 4e12, 8e14)
    bf16 = bench.roofline(config, *args)
    fp8 = bench.roofline(config, *args, weight_bytes=1 + 4 / 128 ** 2, linear_flops=16e14)
    kv = bf16.seconds_memory * 4e12 - 1023 * (projections + other) * 2  # the same in both
    assert fp8.seconds_memory * 4e12 - kv == pytest.approx(
        1023 * (projections * (1 + 4 / 128 ** 2) + other * 2), rel=1e-9)
    assert 1.7 < bf16.seconds_memory / fp8.seconds_memory < 1.75  # not 2: the LM head stays
    assert fp8.seconds_compute < bf16.seconds_compute  # projections at twice the rate
    assert bench.roofline(config, *args, weight_bytes=2).seconds_memory == bf16.seconds_memory

@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_bench_runs_on_cpu(tmp_path, quantization):
    from tiny_model import build_tiny_qwen3
    path = build_tiny_qwen3(str(tmp_path / "m"), vocab_size=10240)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path,
                           "--num-seqs", "4", "--max-input-len", "130", "--max-output-len", "110",
                           "--json", *(["--quantization", quantization, "--disable-cascade-attn"]
                                       if quantization else [])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    _, params = bench.workload(4, 100, 130, 110)
    assert (result["output_tokens"] == sum(sp.max_tokens for sp in params)
            and result["tok_per_s"] > 0)
    assert result["weights"] == ("fp8 per-channel" if quantization else "bf16")
    assert result["cascade_attn"] == (quantization is None)  # the fp8 run also passes the flag


def test_fp8_presets_are_qwens_block_wise_checkpoints():
    """qwen3-*-fp8: the model's config.json with Qwen3-*-FP8's quantization_config (e4m3, 128x128
    blocks)."""
    from nanovllm.features.fp8 import get_quantization_config
    fp8, bf16 = preset_config("qwen3-8b-fp8"), preset_config("qwen3-8b")
    assert fp8.hidden_size == bf16.hidden_size and fp8.num_hidden_layers == bf16.num_hidden_layers
    config = get_quantization_config(fp8, None)
    assert config.is_checkpoint_fp8_serialized and config.weight_block_size == (128, 128)
    assert get_quantization_config(bf16, None) is None


def test_profile_step_times_every_phase(tiny):
    """tools/profile_step.py on CPU: every wrapped phase is timed (a renamed engine method fails
    here)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from profile_step import profile

    from nanovllm import LLM
    llm = LLM(tiny, device="cpu", enforce_eager=True, num_kvcache_blocks=64, kvcache_block_size=16)
    try:
        result = profile(llm, batch=2, context=20, steps=3)
    finally:
        llm.exit()
    for phase in ("schedule", "prepare_decode", "step_tensors", "prepare_sample", "run_model",
                  "postprocess"):
        assert result[phase] > 0, phase
    assert result["step_ms"] > 0 and result["batch"] == 2


TINY_PRESET = ("Qwen3Config", dict(architectures=["Qwen3ForCausalLM"], vocab_size=600,
                                   hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, bos_token_id=500, eos_token_id=502,
                                   tie_word_embeddings=False, dtype="bfloat16"))


def test_startup_time_writes_a_checkpoint_once_and_times_every_phase(tmp_path, monkeypatch):
    """tools/startup_time.py --checkpoint-of: a sharded checkpoint that transformers loads without a
    missing or unexpected tensor, written once; the engine loads it with the tokenizer's EOS; the
    child times each phase of the construction from it (a renamed engine function fails here)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from startup_time import write_checkpoint
    from transformers import AutoModelForCausalLM

    from nanovllm import LLM
    from nanovllm.models import presets
    monkeypatch.setitem(presets.PRESETS, "tiny", TINY_PRESET)
    path = str(tmp_path / "ckpt")
    assert write_checkpoint("tiny", path, 1e-4) > 0 and write_checkpoint("tiny", path, 1e-4) is None
    assert len(glob.glob(os.path.join(path, "model-*-of-*.safetensors"))) > 1
    with pytest.raises(ValueError, match="holds files but no checkpoint"):
        write_checkpoint("tiny", path, 1.0)
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    llm = LLM(path, device="cpu", num_kvcache_blocks=16)
    try:
        assert len(llm.tokenizer) == 600 and llm.config.eos_token_ids[0] == 502
    finally:
        llm.exit()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "startup_time.py"),
                           "--child", "--model", path],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    phases = json.loads(proc.stdout.strip().splitlines()[-1])
    for phase in ("resolve_paths", "hf_config", "tokenizer", "eos_token_ids", "load_weights",
                  "kv_cache"):
        assert phase in phases, phase
    assert (phases["tokenizer"] > 0
            and phases["llm_construction"] >= phases["load_weights"] + phases["tokenizer"])


def test_scenarios_have_their_documented_shapes_and_the_warmup_has_other_tokens():
    batch1, _, _ = bench.scenario_workload(bench.SCENARIOS["batch1"], 0)
    prompts, params, shared = bench.scenario_workload(bench.SCENARIOS["prefix"], 0)
    warm, warm_params, _ = bench.scenario_workload(bench.SCENARIOS["prefix"], 1)
    assert len(batch1) == 1 and len(batch1[0]) == 512
    assert len(prompts) == 256 and shared == 2048 and all(len(p) == 2048 + 128 for p in prompts)
    assert (all(p[:2048] == prompts[0][:2048] for p in prompts)
            and prompts[0][2048:] != prompts[1][2048:])
    assert ([len(p) for p in warm] == [len(p) for p in prompts]
            and warm[0][:2048] != prompts[0][:2048])
    assert all(sp.max_tokens == 128 and sp.temperature == 0.6 and sp.ignore_eos
               for sp in params + warm_params)


def test_roofline_prefills_a_shared_prefix_once():
    config = preset_config("qwen3-0.6b")
    shared = bench.roofline(config, [2048 + 128] * 4, [8] * 4, 4e12, 7e14, shared_prefix=2048)
    alone = bench.roofline(config, [2048 + 128] + [128] * 3, [8] * 4, 4e12, 7e14)
    unshared = bench.roofline(config, [2048 + 128] * 4, [8] * 4, 4e12, 7e14)
    assert shared.seconds_compute < unshared.seconds_compute
    # the same prefill tokens as one full prompt plus three suffixes; the suffixes attend over the
    # prefix too
    assert alone.seconds_compute < shared.seconds_compute


def test_scenario_runs_on_cpu(tmp_path):
    from tiny_model import build_tiny_qwen3
    path = build_tiny_qwen3(str(tmp_path / "m"), vocab_size=10240)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path,
                           "--scenario", "prefix", "--scale", "0.02", "--block-size", "16",
                           "--kv-cache-dtype", "fp8", "--json"],
                          capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["scenario"] == "prefix" and result["num_seqs"] == 256
            and result["output_tokens"] == 256 * 3)
    assert result["block_size"] == 16 and result["kv_cache_dtype"] == "fp8"


def test_roofline_reads_a_shared_prefix_once_per_step():
    config = preset_config("qwen3-0.6b")
    shared = bench.roofline(config, [2048 + 128] * 4, [8] * 4, 4e12, 7e14, shared_prefix=2048)
    unshared = bench.roofline(config, [2048 + 128] * 4, [8] * 4, 4e12, 7e14)
    kv_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    # four prefills of the prefix become one, and 7 decode steps read it once instead of four times
    saved = (3 * 2048 + 3 * 2048 * 7) * kv_token / 4e12
    assert unshared.seconds_memory - shared.seconds_memory == pytest.approx(saved, rel=1e-9)


def test_rl_scenario_is_64_prompts_times_8_completions_at_temperature_1():
    prompts, params, shared = bench.scenario_workload(bench.SCENARIOS["rl"], 0)
    assert len(prompts) == 64 and shared == 0 and all(len(p) == 512 for p in prompts)
    assert all(sp.n == 8 and sp.temperature == 1.0 and sp.max_tokens == 512 and sp.ignore_eos
               for sp in params)


def test_roofline_reads_a_siblings_prompt_once_per_step_for_its_run():
    """Completions of one prompt: the same bytes and FLOPs as a prefix shared by exactly them;
    two prompts of four completions: twice one prompt's K/V traffic, the weights read once."""
    config = preset_config("qwen3-0.6b")
    one = bench.roofline(config, [512] * 4, [8] * 4, 4e12, 7e14, siblings=4)
    as_prefix = bench.roofline(config, [512] * 4, [8] * 4, 4e12, 7e14, shared_prefix=512)
    assert one.seconds_memory == pytest.approx(as_prefix.seconds_memory, rel=1e-12)
    assert one.seconds_compute == pytest.approx(as_prefix.seconds_compute, rel=1e-12)
    two = bench.roofline(config, [512] * 8, [8] * 8, 4e12, 7e14, siblings=4)
    alone = bench.roofline(config, [512] * 8, [8] * 8, 4e12, 7e14)
    kv_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    # per prompt: three prefills fewer and 7 decode steps reading it once instead of four times
    saved = 2 * (3 * 512 + 3 * 512 * 7) * kv_token / 4e12
    assert alone.seconds_memory - two.seconds_memory == pytest.approx(saved, rel=1e-9)
    with pytest.raises(ValueError, match="siblings=3"):
        bench.roofline(config, [512] * 4, [8] * 4, 4e12, 7e14, siblings=3)


def test_rl_scenario_runs_on_cpu(tmp_path):
    from tiny_model import build_tiny_qwen3
    path = build_tiny_qwen3(str(tmp_path / "m"), vocab_size=10240)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path,
                           "--scenario", "rl", "--scale", "0.01", "--block-size", "16", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["num_seqs"] == 64 and result["output_tokens"] == 64 * 8 * 5


def test_kernel_table_counts_launches_busy_and_idle_time():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from profile_step import kernel_table
    # gemm 0-10 and a copy 5-11 (busy 0-11), norm 12-14 (1 us idle before it); 20 us idle; gemm,
    # norm 34-46
    kernels = [("gemm", 0, 10), ("copy", 5, 11), ("norm", 12, 14), ("gemm", 34, 44),
               ("norm", 44, 46)]
    table = kernel_table(kernels, steps=2)
    assert table["launches_per_step"] == 2.5 and table["busy_us_per_step"] == (11 + 2 + 12) / 2
    assert table["idle_us_per_step"] == (1 + 20) / 2  # 11 -> 12 and 14 -> 34
    assert table["kernels"][0] == dict(name="gemm", launches_per_step=1.0, us_per_step=10.0)
    assert [row["name"] for row in table["kernels"]] == ["gemm", "copy", "norm"]


def test_roofline_reads_the_experts_a_moe_step_touches():
    """Qwen3-30B-A3B: a decode step reads the dense weights (attention, routers, embeddings) and, in
    each of the 48 sparse layers, the distinct experts its B running sequences touch: exactly top-k
    = 8 at B = 1, E (1 - (1 - k/E)^B) in expectation; a token computes with 8 of the 128 experts."""
    moe = preset_config("qwen3-30b-a3b")
    h, layers = 2048, 48
    # attention, routers, vocab
    dense = layers * (h * (32 + 2 * 4) * 128 + 32 * 128 * h + 128 * h) + 2 * 151936 * h
    expert = 3 * h * 768
    one = bench.roofline(moe, [10], [5], 1e12, 1e15)  # 4 decode steps at B = 1: 8 experts each
    kv_token = 2 * layers * 4 * 128 * 2
    # decode steps' reads of prompt + outputs, and the prefill's writes
    kv = (10 * 4 + 5 * 4 // 2 + 10) * kv_token
    assert one.seconds_memory * 1e12 == pytest.approx(4 * (dense + layers * 8 * expert) * 2 + kv,
                                                      rel=1e-9)
    # step 1 runs 3 sequences, step 2 two
    three = bench.roofline(moe, [10] * 3, [3, 3, 2], 1e12, 1e15)
    touched = 128 * (1 - (1 - 8 / 128) ** 3) + 128 * (1 - (1 - 8 / 128) ** 2)
    kv = sum(10 * (o - 1) + o * (o - 1) // 2 for o in (3, 3, 2)) * kv_token + 30 * kv_token
    assert three.seconds_memory * 1e12 == pytest.approx(
        2 * dense * 2 + layers * touched * expert * 2 + kv, rel=1e-9)
    # compute: the active matrices (8 experts a token; the LM head apart, the embedding no matmul)
    active = dense - 2 * 151936 * h + layers * 8 * expert
    flops_linear = 2 * active * (10 + 5) + 2 * 151936 * h * (1 + 5)
    flops_attn = 4 * layers * 32 * 128 * (10 * 10 / 2 + 10 * 4 + 5 * 4 // 2)
    assert one.seconds_compute * 1e15 == pytest.approx(flops_linear + flops_attn, rel=1e-9)


@pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                    reason="needs the structured extra")
def test_bench_structured_runs_on_cpu_with_the_handoff():
    """tools/bench_structured.py end to end on the demo model with async scheduling (the bitmask
    handoff's path): both batches run, the JSON batch's bitmasks are counted, and every phase of the
    host's steps is timed."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_structured.py"),
                          "--model", "nanovllm:demo", "--num-seqs", "4", "--prompt-len", "16",
                          "--output-len", "12", "--reps", "1", "--async-scheduling", "--phases",
                          "--json"], capture_output=True, text=True, timeout=600, check=True,
                         cwd=ROOT).stdout
    record = json.loads(out.splitlines()[-1])
    assert record["async_scheduling"] and record["handoff"]
    free, constrained = record["runs"]["free"][0], record["runs"]["json"][0]
    assert free["output_tokens"] == 4 * 12 and free["fill_calls"] == 0
    assert constrained["fill_calls"] > 0 and constrained["xgrammar_ms_per_call"] > 0
    phases = constrained["host_ms_per_step"]
    assert phases["steps"] > 0 and phases["bitmask_launch"] > 0 and phases["accept"] > 0
    assert record["bitmask_handoff"] == "host"  # the CPU's: the launch waits for the fill


def test_speculative_scenario_runs_on_cpu(tmp_path):
    """batch1-ngram: the scenario's speculative_config reaches the engine; the JSON says what the
    proposer did in the timed run."""
    from tiny_model import build_tiny_qwen3
    path = build_tiny_qwen3(str(tmp_path / "m"), vocab_size=10240)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--model", path,
                           "--scenario", "batch1-ngram", "--scale", "0.1", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["speculative_config"]["method"] == "ngram" and result["output_tokens"] == 102
    assert result["spec_draft_tokens"] >= 0 and 0 <= result["spec_acceptance"] <= 1
    assert result["async_scheduling"] is False


def test_bench_spec_oracle_keeps_the_set_acceptance(tmp_path):
    """tools/bench_spec.py --oracle on a tiny checkpoint: each verify step keeps the set number of
    tokens (the proposer's first m - 1 are right), and the outputs are the plain run's."""
    from tiny_model import build_tiny_qwen3
    path = build_tiny_qwen3(str(tmp_path / "m"), vocab_size=10240)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_spec.py"),
                           "--oracle", "--model", path, "--batch", "1", "3", "--accept", "2",
                           "3", "--k", "3", "--prompt-len", "20", "--output-len", "25"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    oracle = [r for r in rows if r["proposer"] == "oracle"]
    assert len(oracle) == 4 and all(r["same_as_plain"] == f"{r['batch']}/{r['batch']}"
                                    for r in oracle)
    for r in oracle:  # the last step of a sequence may be cut by max_tokens
        assert abs(r["accept"] - {2: 2.0, 3: 3.0}[round(r["accept"])]) < 0.1, r
    assert sorted(round(r["accept"]) for r in oracle) == [2, 2, 3, 3]
