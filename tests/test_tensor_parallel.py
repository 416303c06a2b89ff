"""Specification of tensor parallelism on CPU (gloo): TP=2, 4 and 8 give transformers' greedy output
token for token (Qwen3, Llama and Qwen3-MoE checkpoints, async scheduling, prompt logprobs), and TP
engines run side by side with other engines in one process."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import (
    CPU_ENGINE,
    ENGINE,
    assert_matches_oracle,
    assert_no_leaks,
    assert_prompt_logprobs,
    random_prompts,
    run_engine,
)
from tiny_model import build_tiny_model, build_tiny_qwen3

from nanovllm import LLM, SamplingParams

N = 32


GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


# ---- TP=2 ----------------------------------------------------------------------------------------
def test_tensor_parallel_gloo(checkpoints, oracle):
    path = checkpoints["gqa4_hd128_sharded"]
    prompts = random_prompts(16, 3, 70, seed=6)
    outputs, _ = run_engine(path, prompts, GREEDY, tensor_parallel_size=2, device="cpu")
    assert_matches_oracle(oracle, path, prompts, outputs, N)


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
    # one after another
    out_again, _ = run_engine(b, prompts, GREEDY, tensor_parallel_size=2, device="cpu")
    assert [o["token_ids"] for o in out_again] == [o["token_ids"] for o in out_b]


def test_llama_tensor_parallel(family_checkpoints, oracle):
    path = family_checkpoints["llama_linear_rope_all_biases"]
    prompts = random_prompts(8, 3, 60, seed=71)
    llm = LLM(path, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=512, device="cpu",
              tensor_parallel_size=2)
    try:
        outputs = llm.generate(prompts,
                               SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.exit()
    assert_matches_oracle(oracle, path, prompts, outputs, N)


def test_qwen3_moe_tensor_parallel(tmp_path, oracle):
    """Qwen3-MoE at TP=2: each rank holds half of every expert's intermediate dimension (and a dense
    layer's), the router whole; the partial down projections are summed by the all-reduce."""
    path = build_tiny_model(str(tmp_path / "moe"), "qwen3_moe", head_dim=32, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                            num_hidden_layers=3, mlp_only_layers=[1])
    prompts = random_prompts(8, 3, 60, seed=72)
    outputs, _ = run_engine(path, prompts,
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                            tensor_parallel_size=2, device="cpu")
    assert_matches_oracle(oracle, path, prompts, outputs, 16)


def test_async_tensor_parallel_gloo(checkpoints, oracle):
    """TP=2: the sampled tokens reach rank 1 by a broadcast from rank 0, and outputs stay exact."""
    path = checkpoints["gqa4_hd128_sharded"]
    prompts = random_prompts(10, 3, 70, seed=32)
    llm = LLM(path, **ENGINE, tensor_parallel_size=2, device="cpu", async_scheduling=True)
    try:
        outputs = llm.generate(prompts,
                               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert_matches_oracle(oracle, path, prompts, outputs, 12)


def test_prompt_logprobs_tensor_parallel(checkpoints, oracle):
    path = checkpoints["gqa4_hd128_sharded"]
    prompts = random_prompts(3, 10, 60, seed=54)
    llm = LLM(path, **ENGINE, tensor_parallel_size=2, device="cpu", max_num_batched_tokens=32)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                       prompt_logprobs=2),
                               use_tqdm=False)
    finally:
        llm.exit()
    for prompt, out in zip(prompts, outputs):
        assert_prompt_logprobs(oracle.model(path), prompt, out["prompt_logprobs"], 2)


def test_a_forked_child_leaves_the_parents_tensor_parallel_engine_working(tiny, tmp_path):
    """A child forked from rank 0 that exits (``sys.exit``, running multiprocessing's exit handler
    and the finalizers, or ``os._exit``) neither ends the parent's workers nor unlinks their memory;
    one that tries the engine is refused. The parent then generates the same greedy tokens as before
    the fork."""
    script = tmp_path / "fork.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        from nanovllm import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2]))
            greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            tokens = lambda: [o.outputs[0].token_ids
                              for o in llm.generate([[1, 2, 3], [4, 5]], greedy, use_tqdm=False)]
            segment = "/dev/shm/" + llm.workers.channel.shm.name
            result = dict(before=tokens(), statuses=[], after=[], segment_kept=[])
            for how in ("sys.exit", "os._exit", "generate"):
                if (pid := os.fork()) == 0:
                    if how == "generate":
                        try:
                            llm.generate([[1, 2]], greedy, use_tqdm=False)
                        except RuntimeError as e:
                            sys.exit(0 if "belong to the process that forked this one" in str(e)
                                     else 3)
                        sys.exit(4)
                    sys.exit(0) if how == "sys.exit" else os._exit(0)
                result["statuses"].append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
                result["segment_kept"].append(os.path.exists(segment))
                result["after"].append(tokens())
            llm.exit()
            print(json.dumps(result))
    """))
    proc = subprocess.run([sys.executable, str(script), tiny, json.dumps(CPU_ENGINE)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["statuses"] == [0, 0, 0]
    assert result["segment_kept"] == [True, True, True]
    assert result["after"] == [result["before"]] * 3


# ---- TP=4 and TP=8 -------------------------------------------------------------------------------
# a tiny checkpoint with 8 query and 8 KV heads, so that every rank holds one head of each
@pytest.fixture(scope="module")
def kv8(tmp_path_factory):
    return build_tiny_qwen3(str(tmp_path_factory.mktemp("kv8") / "m"), num_attention_heads=8,
                            num_key_value_heads=8, head_dim=32, intermediate_size=256)


@pytest.mark.parametrize("tp", [4, 8])
def test_tensor_parallel_4_and_8(kv8, oracle, tp):
    prompts = random_prompts(8, 3, 60, seed=90)
    llm = LLM(kv8, tensor_parallel_size=tp, device="cpu", kvcache_block_size=16,
              num_kvcache_blocks=128, max_model_len=256)
    try:
        outputs = llm.generate(prompts,
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.exit()
    assert_matches_oracle(oracle, kv8, prompts, outputs, 16)


def test_fp8_cache_and_sliding_window_tensor_parallel(family_checkpoints):
    """TP=2 with an fp8 cache on a checkpoint mixing full and windowed layers: each rank stores and
    reads its own KV heads, so the prompt logprobs (chunked prefill reading the cache past the
    window) and the greedy tokens follow TP=1's on the same cache dtype. Not bit for bit: the
    all-reduce sums in another order, and a value that lands on the other side of an e4m3 rounding
    boundary moves a logprob by ~1e-3."""
    path = family_checkpoints["qwen2_window_mixed"]
    prompts = random_prompts(4, 40, 70, seed=73)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    results = []
    for tp in (1, 2):
        outputs, _ = run_engine(path, prompts, sp, tensor_parallel_size=tp, kv_cache_dtype="fp8",
                                max_num_batched_tokens=32, device="cpu")
        results.append(outputs)
    diffs, same, total = [], 0, 0
    for one, two in zip(*results):
        diffs += [abs(e1[t] - e2[t])
                  for e1, e2, t in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:],
                                       one.prompt_token_ids[1:])]
        same += sum(a == b for a, b in zip(one.outputs[0].token_ids, two.outputs[0].token_ids))
        total += len(one.outputs[0].token_ids)
    assert max(diffs) < 0.05 and sum(diffs) / len(diffs) < 1e-3
    assert same >= 0.75 * total
