"""CUDA path: CUDA Graph decode on and off, float32 against transformers exactly, bf16 within a
stated tolerance, KV-cache sizing. Skipped without a GPU (the rest of the suite also runs on
CUDA when one is present: the engine picks it by default)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import assert_matches_oracle, assert_no_leaks, random_prompts

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu
N = 32
# bf16 carries ~3 significant digits; in these tiny random models (|logit| ~ 5) two correct bf16
# implementations differ by up to a few hundredths of a logit. Every token nanovllm picks must
# be within this of transformers' best logit at that position (teacher-forced on nanovllm's output).
BF16_TIE = 0.1


def _generate(path, prompts, max_tokens, **kw):
    llm = LLM(path, kvcache_block_size=16, max_model_len=512, device="cuda", **kw)
    try:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaks(llm)
        return outputs, llm
    finally:
        llm.exit()


@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("name", ["gqa2", "gqa4_hd128_sharded"])
def test_float32_matches_transformers(checkpoints, oracle, name, enforce_eager):
    path = checkpoints[name]
    prompts = random_prompts(21, 3, 90, seed=21)  # 21 sequences: graph bucket 32, padded rows
    outputs, llm = _generate(path, prompts, [N] * 21, dtype="float32", enforce_eager=enforce_eager)
    assert_matches_oracle(oracle, path, prompts, outputs, N)


def test_graph_batches_shrink(checkpoints, oracle):
    """Sequences finish at different steps, so decode replays many buckets with padding."""
    path = checkpoints["gqa2"]
    prompts = random_prompts(20, 3, 50, seed=22)
    lengths = [4 + 3 * i for i in range(20)]
    outputs, _ = _generate(path, prompts, lengths, dtype="float32", max_num_seqs=20)
    for prompt, n, out in zip(prompts, lengths, outputs):
        assert_matches_oracle(oracle, path, [prompt], [out], n)


def test_graph_buckets_cover_max_num_seqs(tiny):
    llm = LLM(tiny, kvcache_block_size=16, max_model_len=256, max_num_seqs=20, device="cuda")
    try:
        assert llm.model_runner.graphs.batch_sizes == [1, 2, 4, 8, 16, 20]
    finally:
        llm.exit()


def _bf16_shortfall(oracle, path, prompts, outputs) -> tuple[float, float]:
    """Teacher-forced on nanovllm's tokens: the worst gap between transformers' (bf16) best logit
    and the logit of the token nanovllm chose, and the share of positions where they differ."""
    model = oracle.model(path, "cuda", torch.bfloat16)
    worst, differs, total = 0.0, 0, 0
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt + out["token_ids"]], device="cuda")
        with torch.no_grad():
            # what predicted each generated token
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(
            1, torch.tensor(out["token_ids"], device="cuda").unsqueeze(1)).squeeze(1)
        shortfall = logits.max(1).values - chosen
        worst, differs, total = max(worst, float(shortfall.max())), \
            differs + int((shortfall > 0).sum()), total + len(out["token_ids"])
    return worst, differs / total


BACKENDS = ["triton", pytest.param("flash-attn", marks=pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")), "torch"]
# engine arguments and prompts that force each feature on (blocks of 256, flash-attn's minimum)
FEATURES = {
    "plain": dict(),
    "prefix_cache": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=100),
    "preemption": dict(num_kvcache_blocks=6),
}


# Every feature with each fast backend under CUDA Graphs and async scheduling (the defaults); eager
# mode, synchronous scheduling and the PyTorch reference backend on the plain workload (the full
# cross product would take several times as long).
CASES = [(b, f, False, True) for b in BACKENDS[:2] for f in FEATURES] + \
    [(b, "plain", True, True) for b in BACKENDS] + \
    [(b, "plain", False, False) for b in BACKENDS[:2]] + [("torch", "plain", False, True)]


def _case_id(backend, feature, enforce_eager, async_scheduling) -> str:
    backend = getattr(backend, "values", [backend])[0]
    return (f"{backend}-{feature}-{'eager' if enforce_eager else 'graphs'}-"
            f"{'async' if async_scheduling else 'sync'}")


@pytest.mark.parametrize("backend, feature, enforce_eager, async_scheduling",
                         [pytest.param(*c, id=_case_id(*c), marks=getattr(c[0], "marks", ()))
                          for c in CASES])
def test_bfloat16_backends_and_features(checkpoints, oracle, backend, feature, enforce_eager,
                                        async_scheduling):
    backend = getattr(backend, "values", [backend])[0]
    path = checkpoints["gqa4_hd128_sharded"]  # head_dim 128: what the trimmed flash-attn build has
    shared = random_prompts(1, 300, 300, seed=31)[0]
    prompts = random_prompts(12, 150, 300, seed=32) if feature != "prefix_cache" else \
        [shared + tail for tail in random_prompts(6, 1, 40, seed=33)]
    llm = LLM(path, kvcache_block_size=256, max_model_len=1024, max_num_seqs=32, device="cuda",
              dtype="bfloat16", attention_backend=backend, enforce_eager=enforce_eager,
              async_scheduling=async_scheduling, **FEATURES[feature])
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    preempted, original_preempt = [], llm.scheduler.preempt

    def preempt(seq):
        preempted.append(seq.seq_id)
        original_preempt(seq)

    llm.scheduler.preempt = preempt
    try:
        if feature == "prefix_cache":
            outputs = (llm.generate(prompts[:1], sp, use_tqdm=False)
                       + llm.generate(prompts[1:], sp, use_tqdm=False))
            assert llm.scheduler.block_manager.num_cache_hits >= 5
        else:
            outputs = llm.generate(prompts, sp, use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert bool(preempted) == (feature == "preemption")
    worst, rate = _bf16_shortfall(oracle, path, prompts, outputs)
    print(f"bf16 {_case_id(backend, feature, enforce_eager, async_scheduling)}: token differs from "
          f"transformers' bf16 argmax at {rate:.1%} of positions; worst logit shortfall "
          f"{worst:.4f} (tolerance {BF16_TIE})")
    assert worst < BF16_TIE and rate < 0.1


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_kv_cache_sizing_respects_utilization(tiny, enforce_eager):
    """The KV sizing (what is left under gpu_memory_utilization after the warmup's peak) fills
    memory up to gpu_memory_utilization (less the warmup's activation headroom). CUDA graphs are
    captured after the sizing, as nano-vllm does, so their pool comes on top: it is reported, and
    held under 2% of the card."""
    torch.cuda.empty_cache()
    llm = LLM(tiny, kvcache_block_size=256, device="cuda", gpu_memory_utilization=0.3,
              enforce_eager=enforce_eager)
    try:
        free, total = torch.cuda.mem_get_info()
        runner = llm.model_runner
        assert (runner.num_kvcache_blocks > 0
                and llm.config.num_kvcache_blocks == runner.num_kvcache_blocks)
        assert runner.kv_cache.numel() * runner.kv_cache.element_size() == \
            runner.num_kvcache_blocks * runner._block_bytes()
        used = (total - free) / total
        print(f"enforce_eager={enforce_eager}: {used:.4f} of the card in use after start-up "
              f"(cap 0.3)")
        assert used <= 0.3 + (0.002 if enforce_eager else 0.02)
    finally:
        llm.exit()


def test_async_scheduling_matches_sync(tiny):
    """float32, CUDA Graphs: async scheduling on and off give the same tokens and finish reasons,
    greedy (with stop ids met part-way) and seeded sampling."""
    prompts = random_prompts(24, 5, 120, seed=40)
    outputs = {}
    for mode in (False, True):
        llm = LLM(tiny, kvcache_block_size=16, max_model_len=512, device="cuda", dtype="float32",
                  async_scheduling=mode)
        try:
            if not outputs:
                probe = llm.generate(prompts[:8],
                                     SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                     use_tqdm=False)
                stops = [out["token_ids"][5 + i] for i, out in enumerate(probe)]
            params = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stops[i]])
                      for i in range(8)] + \
                [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=10 + i,
                                ignore_eos=True) for i in range(8)] + \
                [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
                 for i in range(8)]
            outputs[mode] = [(o["token_ids"], o["finish_reason"])
                             for o in llm.generate(prompts, params, use_tqdm=False)]
            assert_no_leaks(llm)
        finally:
            llm.exit()
    assert [r for _, r in outputs[False][:8]].count("stop") >= 4
    assert outputs[True] == outputs[False]


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@two_gpus
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_tensor_parallel_2_float32_matches_transformers(checkpoints, oracle, async_scheduling):
    """NCCL, 2 GPUs, CUDA Graphs: greedy output equal to transformers' (near-tie rule: the
    all-reduce sums in another order)."""
    path = checkpoints["gqa4_hd128_sharded"]
    prompts = random_prompts(21, 3, 90, seed=41)
    outputs, _ = _generate(path, prompts, [N] * 21, dtype="float32", tensor_parallel_size=2,
                           async_scheduling=async_scheduling)
    assert_matches_oracle(oracle, path, prompts, outputs, N)


@two_gpus
def test_tensor_parallel_2_bfloat16(checkpoints, oracle):
    path = checkpoints["gqa4_hd128_sharded"]
    prompts = random_prompts(12, 150, 300, seed=32)
    llm = LLM(path, kvcache_block_size=256, max_model_len=1024, max_num_seqs=32, device="cuda",
              dtype="bfloat16", tensor_parallel_size=2)
    try:
        outputs = llm.generate(prompts,
                               SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                               use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    worst, rate = _bf16_shortfall(oracle, path, prompts, outputs)
    print(f"bf16 TP=2: token differs from transformers' bf16 argmax at {rate:.1%} of positions; "
          f"worst logit shortfall {worst:.4f} (tolerance {BF16_TIE})")
    assert worst < BF16_TIE and rate < 0.1


@two_gpus
def test_tensor_parallel_2_dead_worker_raises(tiny):
    """NCCL would wait forever for a dead rank: the watchdog aborts the group and the engine names
    the rank."""
    import os
    import signal
    import threading
    import time
    llm = LLM(tiny, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=512, device="cuda")
    worker = llm.workers.processes[0]
    threading.Timer(3.0, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.time()
    with pytest.raises(RuntimeError, match=r"worker rank 1 died"):
        for _ in range(100):
            llm.generate([[1] * 20] * 8, SamplingParams(max_tokens=450, ignore_eos=True),
                         use_tqdm=False)
    assert time.time() - start < 60
    llm.exit()


def test_nccl_group_collectives_eager_and_in_a_graph():
    """The engine's own NCCL group (no torch.distributed default group), here of one rank: the
    collectives the layers use, eager and captured in a CUDA graph (decode under TP replays them),
    then abort."""
    from nanovllm.engine.worker_group import TPGroup, free_port
    group = TPGroup(0, 1, free_port(), "cuda")
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    assert torch.equal(group.all_reduce(x.clone()), x)
    assert torch.equal(group.broadcast(x.clone(), 0), x)
    parts = group.gather(x.clone(), 0)
    assert len(parts) == 1 and torch.equal(parts[0], x)
    buf = x.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        group.all_reduce(buf)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        group.all_reduce(buf)
        buf.mul_(2)
    buf.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buf, 2 * x)
    group.abort()
