"""Specification of the engine end to end: greedy output equals transformers' token for token with
each feature forced on (prefix caching, chunked prefill, preemption, a large batch, the Triton
backend), n > 1 completions sharing their prompt's blocks, and async scheduling giving the same
outputs as the synchronous loop."""
from __future__ import annotations

import pytest
import torch
from conftest import (
    CHECKPOINTS,
    ENGINE,
    assert_matches_oracle,
    assert_no_leaks,
    random_prompts,
    run_engine,
)

from nanovllm import LLM, SamplingParams

N = 32


GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


# ---- greedy output against transformers, each feature forced on ----------------------------------
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_transformers(checkpoints, oracle, name):
    prompts = random_prompts(16, 3, 70, seed=1)  # lengths cross 16-token block boundaries
    outputs, _ = run_engine(checkpoints[name], prompts, GREEDY)
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
    outputs, _ = run_engine(tiny, prompts, GREEDY, max_num_batched_tokens=budget)
    assert_matches_oracle(oracle, tiny, prompts, outputs, N)


def test_preemption(tiny, oracle):
    prompts = random_prompts(16, 20, 60, seed=5)
    # 192 slots for 16 sequences of up to 92 tokens
    llm = LLM(tiny, **{**ENGINE, "num_kvcache_blocks": 12})
    try:
        assert llm.config.num_kvcache_blocks == 12
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert llm.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"
    assert_matches_oracle(oracle, tiny, prompts, outputs, N)


def test_large_batch(tiny, oracle):
    prompts = random_prompts(160, 2, 40, seed=7)
    outputs, _ = run_engine(tiny, prompts, GREEDY, max_num_seqs=64)
    assert_matches_oracle(oracle, tiny, prompts, outputs, N)


def test_triton_backend(checkpoints, oracle):
    """The whole engine through the Triton kernels (interpreted on CPU), prefix cache and chunks
    included."""
    path = checkpoints["gqa4_hd128_sharded"]
    shared = random_prompts(1, 40, 40, seed=9)[0]
    prompts = random_prompts(4, 3, 40, seed=10) + [shared + [1], shared + [2, 3]]
    llm = LLM(path, **{**ENGINE, "attention_backend": "triton", "max_num_batched_tokens": 64})
    try:
        assert llm.model_runner.attention_backend.name == "triton"
        outputs = llm.generate(prompts[:5],
                               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
        outputs += llm.generate(prompts[5:],
                                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
        assert llm.scheduler.block_manager.num_cache_hits >= 2
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert_matches_oracle(oracle, path, prompts, outputs, 12)


# ---- n > 1 ---------------------------------------------------------------------------------------
def test_n_completions_share_the_prompt_blocks(llm):
    prompt = random_prompts(1, 70, 70, seed=46)[0]  # 4 full blocks of 16, then 6 tokens
    hits = llm.scheduler.block_manager.num_cache_hits
    out = llm.generate([prompt],
                       SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    # completions 1-3 reuse all 4 full blocks
    assert llm.scheduler.block_manager.num_cache_hits - hits >= 3 * 4
    assert len(out["outputs"]) == 4 and out["token_ids"] == out["outputs"][0]["token_ids"]
    assert len({tuple(o["token_ids"]) for o in out["outputs"]}) > 1
    greedy = llm.generate([prompt],
                          SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len({tuple(o["token_ids"]) for o in greedy["outputs"]}) == 1
    assert_no_leaks(llm)


# ---- async scheduling ----------------------------------------------------------------------------
# Step N+1 is scheduled and launched before step N's tokens are read; the outputs are those of the
# synchronous loop: every stop condition ends a sequence on the same token, and the token computed
# in flight after it never shows. On CPU the forward is synchronous, but the engine's bookkeeping
# (placeholders, the device-side hand-over of sampled tokens, dropped in-flight tokens, TP
# broadcast) is the same code as on CUDA.
# 24 blocks of 16 tokens for 14 requests of up to ~110 tokens: preemption; a 48-token budget:
# chunked prefill
SQUEEZED = {**ENGINE, "num_kvcache_blocks": 24, "max_num_batched_tokens": 48}


def _engine(path, async_scheduling, **kw):
    llm = LLM(path, **{**SQUEEZED, **kw}, async_scheduling=async_scheduling)
    assert llm.config.async_scheduling is async_scheduling
    return llm


PROMPTS = random_prompts(14, 8, 60, seed=31)


def _stops(llm) -> tuple[list[int], list[str]]:
    """Stop ids and stop strings that greedy decoding of their prompts meets part-way through."""
    probe = llm.generate([PROMPTS[i] for i in (2, 3, 4, 11, 12)],
                         SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)
    stop_ids = [out["token_ids"][k] for out, k in zip(probe, (9, 3, 14))]
    stop_strs = [next(chr(t) for t in out["token_ids"][k:] if chr(t).isalnum() and t < 128)
                 for out, k in zip(probe[3:], (6, 4))]
    return stop_ids, stop_strs


def _workload(stop_ids: list[int], stop_strs: list[str]):
    g = dict(temperature=0)
    params = [
        SamplingParams(**g, max_tokens=40, ignore_eos=True),
        SamplingParams(**g, max_tokens=7, ignore_eos=True),
        SamplingParams(**g, max_tokens=40, stop_token_ids=[stop_ids[0]]),        # stops mid-run
        SamplingParams(**g, max_tokens=40, stop_token_ids=[stop_ids[1]], min_tokens=6),
        SamplingParams(**g, max_tokens=40, stop_token_ids=[stop_ids[2]], logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=6, n=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=7, max_tokens=25, ignore_eos=True,
                       logprobs=2),
        SamplingParams(**g, n=2, max_tokens=40, stop_token_ids=[stop_ids[0]]),
        SamplingParams(temperature=0.9, seed=9, max_tokens=15, ignore_eos=True),
        SamplingParams(**g, max_tokens=1, ignore_eos=True),
        SamplingParams(**g, max_tokens=40, stop=[stop_strs[0], "never seen"]),  # stop strings
        SamplingParams(**g, max_tokens=40, stop=[stop_strs[1]], include_stop_str_in_output=True),
        SamplingParams(**g, max_tokens=40, ignore_eos=True),
    ]
    return PROMPTS, params


# penalties read every generated token, so a batch that has them waits for the step in flight
PENALTIES = [SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, seed=8,
                            max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0.9, repetition_penalty=1.3, seed=9, max_tokens=15,
                            ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]


def _comparable(outputs: list[dict]) -> list[dict]:
    """Everything but the timings; logprobs rounded (a row's float sums depend on its batch)."""
    def rounded(logprobs):
        return [{t: round(v, 3) for t, v in d.items()} for d in logprobs]
    out = []
    for o in outputs:
        o = {k: v for k, v in o.items() if k not in ("metrics", "request_id")}
        o["outputs"] = [{**c, "logprobs": rounded(c["logprobs"]),
                         "cumulative_logprob": round(c["cumulative_logprob"], 3)}
                        if "logprobs" in c else c
                        for c in o["outputs"]]
        if "logprobs" in o:
            o["logprobs"] = rounded(o["logprobs"])
        out.append(o)
    return out


def test_async_matches_sync_on_a_mixed_workload(tiny):
    sync = _engine(tiny, False)
    try:
        prompts, params = _workload(*_stops(sync))
        expected = _comparable(sync.generate(prompts, params, use_tqdm=False))
        expected_penalties = _comparable(sync.generate(PROMPTS[:3], PENALTIES, use_tqdm=False))
    finally:
        sync.exit()
    reasons = [out["finish_reason"] for out in expected]
    assert (reasons[2] == reasons[4] == reasons[11] == reasons[12] == "stop"
            and reasons[0] == "length")

    llm = _engine(tiny, True)
    steps_with_two_in_flight = []
    original_forward = llm.model_runner.forward

    def spy_forward(step, sampling=None):
        if llm.core.inflight is not None:
            steps_with_two_in_flight.append(step.prev_rows is not None)
        return original_forward(step, sampling)

    llm.model_runner.forward = spy_forward
    try:
        # the same probe, so the same prefix-cache state
        assert _workload(*_stops(llm))[1] == params
        got = _comparable(llm.generate(prompts, params, use_tqdm=False))
        assert (_comparable(llm.generate(PROMPTS[:3], PENALTIES, use_tqdm=False))
                == expected_penalties)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert llm.scheduler.num_preemptions > 0, "the small cache should have forced preemption"
    assert any(steps_with_two_in_flight), \
        "no step was launched while the previous one was in flight"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"request {i} ({params[i]}) differs with async scheduling"


def test_async_stream_matches_sync(tiny):
    prompts = ["Hello there", "async", "streams the same text"]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, stop=["a"]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True)]
    pieces = {}
    for mode in (False, True):
        llm = _engine(tiny, mode)
        try:
            pieces[mode] = sorted((p["index"], p["text"], tuple(p["token_ids"]), p["finished"])
                                  for p in llm.stream(prompts, params))
            assert_no_leaks(llm)
        finally:
            llm.exit()
    assert pieces[True] == pieces[False]


def test_penalty_batch_whose_sequences_all_stop_in_flight(tiny):
    """A penalties batch waits for the step in flight; if that step finishes every sequence of the
    batch, nothing is launched and the run goes on (it used to raise)."""
    prompt = [5, 17, 33, 2, 9, 100]
    outs = {}
    for mode in (False, True):
        llm = _engine(tiny, mode)
        try:
            ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                        ignore_eos=True, presence_penalty=0.5),
                               use_tqdm=False)[0]["token_ids"]
            sp = SamplingParams(temperature=0, max_tokens=10, presence_penalty=0.5,
                                stop_token_ids=[ref[3]])
            outs[mode] = llm.generate([prompt], sp, use_tqdm=False)
            assert_no_leaks(llm)
        finally:
            llm.exit()
    assert outs[False][0]["token_ids"] == ref[:4] and outs[False][0]["finish_reason"] == "stop"
    assert _comparable(outs[True]) == _comparable(outs[False])


def test_step_reports_each_finished_sequence_once(tiny):
    """A sequence that stops on a token was already launched into the next step: step() still
    reports it finished once."""
    llm = _engine(tiny, True)
    try:
        prompts = random_prompts(6, 5, 30, seed=33)
        probe = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)
        for i, (prompt, out) in enumerate(zip(prompts, probe)):
            llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=20,
                                                   stop_token_ids=[out["token_ids"][i]]),
                            index=i)
        finished = []
        while llm.has_unfinished_requests():
            finished += [out.request_id for out in llm.step() if out.finished]
        assert len(finished) == len(set(finished)) == 6
    finally:
        llm.exit()


def test_prefix_cache_registers_blocks_of_short_and_overlapping_requests(tiny):
    """Blocks are registered when their forward is launched (so the next schedule can use them) and
    before a sequence that ends on that step frees them: a max_tokens=1 request caches its prompt,
    and prompts sharing a prefix admitted in consecutive steps find it, in both modes alike."""
    base = random_prompts(1, 48, 48, seed=34)[0]  # 3 full blocks of 16
    for mode in (False, True):
        llm = _engine(tiny, mode, max_num_batched_tokens=64)
        try:
            one = SamplingParams(temperature=0, max_tokens=1)
            llm.generate([base + [7]], one, use_tqdm=False)
            assert llm.generate([base + [7]], one, use_tqdm=False)[0]["num_cached_tokens"] == 48
            hits = llm.scheduler.block_manager.num_cache_hits
            llm.generate([base[:40] + [9] * 10],
                         SamplingParams(temperature=0.8, n=3, max_tokens=1, seed=1), use_tqdm=False)
            # 2 from base, 3 per sibling
            assert llm.scheduler.block_manager.num_cache_hits - hits == 2 + 2 * 3
            other = random_prompts(1, 48, 48, seed=35)[0]
            outs = llm.generate([other + [1, 2], other + [3, 4, 5], other + [6]],
                                SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
            # the third is admitted a step later
            assert [o["num_cached_tokens"] for o in outs] == [0, 0, 48], mode
            assert_no_leaks(llm)
        finally:
            llm.exit()


# ---- the fp8 KV cache (vLLM's kv_cache_dtype="fp8") ----------------------------------------------
def test_fp8_kv_cache_quality_and_capacity():
    """e4m3 with scales of 1.0, on the reference backend. On the demo model's held-out code (400
    tokens of each of four files, prefilled in chunks of 64, so every chunk after the first reads
    its prefix from the cache), the prompt perplexity is within 2% of the float32 cache's; a value
    is one byte instead of four, so the same budget holds four times the blocks; most greedy tokens
    are unchanged."""
    import glob
    import math
    import os

    import nanovllm
    files = sorted(glob.glob(os.path.join(os.path.dirname(nanovllm.__file__), "demo", "model",
                                          "heldout", "*.py")))
    results = {}
    for kv in ("auto", "fp8"):
        llm = LLM("nanovllm:demo", kv_cache_dtype=kv, kvcache_block_size=16,
                  max_num_batched_tokens=64, max_model_len=512, cpu_kvcache_space=0.01,
                  device="cpu")
        try:
            tokenizer = llm.get_tokenizer()
            prompts = [{"prompt_token_ids": tokenizer.encode(open(f).read())[:400]}
                       for f in files[:4]]
            outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)
            nll = [-e[t] for o in outs
                   for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
            greedy = llm.generate(prompts,
                                  SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                  use_tqdm=False)
            results[kv] = (math.exp(sum(nll) / len(nll)), llm.config.num_kvcache_blocks,
                           [o.outputs[0].token_ids for o in greedy],
                           llm.model_runner.kv_cache.dtype)
        finally:
            llm.exit()
    (ppl, blocks, tokens, dtype), (ppl8, blocks8, tokens8, dtype8) = results["auto"], results["fp8"]
    assert dtype == torch.float32 and dtype8 == torch.float8_e4m3fn
    assert abs(ppl8 / ppl - 1) < 0.02 and ppl8 != ppl  # the cache was read, and it changed little
    assert blocks8 // 4 == blocks  # (the budget divided by a block's bytes, rounded down)
    same = sum(a == b for x, y in zip(tokens, tokens8) for a, b in zip(x, y))
    assert same >= 0.75 * sum(map(len, tokens))


def test_fp8_store_saturates_and_reads_back():
    """Values past e4m3's range are stored as +-448 (not NaN); decode reads the cache as the
    dequantized values."""
    from nanovllm.kernels import reference
    k = torch.tensor([[[1000.0, -1000.0, 0.3, 2.0]]])
    k_cache = torch.zeros(1, 4, 1, 4, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    reference.store_kvcache(k, k, k_cache, v_cache, torch.tensor([2]))
    stored = k_cache.float()[0, 2, 0]
    assert (stored.tolist()[:2] == [448.0, -448.0] and abs(stored[2] - 0.3) < 0.02
            and not stored.isnan().any())
    q = torch.randn(1, 2, 4)
    out = reference.decode_attention(q, k_cache, v_cache, torch.tensor([3]), torch.tensor([[0]]),
                                     0.5)
    ref = reference.decode_attention(q, k_cache.float(), v_cache.float(), torch.tensor([3]),
                                     torch.tensor([[0]]), 0.5)
    assert torch.equal(out, ref)


def test_fp8_kv_cache_is_refused_by_flash_attn():
    """flash-attn 2 reads the cache in the model's dtype: it names the setting ("auto" passes over
    it)."""
    from nanovllm.layers.attention import BACKENDS
    reasons = BACKENDS["flash-attn"][0]("cuda", torch.bfloat16, 256, 128, torch.float8_e4m3fn)
    assert any("kv_cache_dtype" in r for r in reasons)
    assert not any("kv_cache_dtype" in r for r in BACKENDS["triton"][0]("cpu", torch.float32, 16,
                                                                          64, torch.float8_e4m3fn))


def demo_with_kv_scales(tmp_path, tensors: dict[str, torch.Tensor]) -> str:
    """The demo checkpoint plus a safetensors file of KV-cache scales, as fp8 checkpoints ship
    them."""
    import os
    import shutil

    from safetensors.torch import save_file

    import nanovllm
    path = str(tmp_path / "demo_kv_scales")
    shutil.copytree(os.path.join(os.path.dirname(nanovllm.__file__), "demo", "model"), path)
    save_file(tensors, os.path.join(path, "kv_scales.safetensors"))
    return path


def heldout_prompts(tokenizer, n: int, tokens: int) -> list[dict]:
    import glob
    import os

    import nanovllm
    files = sorted(glob.glob(os.path.join(os.path.dirname(nanovllm.__file__), "demo", "model",
                                          "heldout", "*.py")))
    return [{"prompt_token_ids": tokenizer.encode(open(f).read())[:tokens]} for f in files[:n]]


def test_fp8_kv_cache_with_checkpoint_scales_on_triton_and_reference(tmp_path):
    """A checkpoint's k_scale/v_scale (vLLM's names, on the attention or its k/v projection) are
    loaded per layer and undone on read: the fp8 cache stored at scales 4 and 0.25 gives the demo's
    held-out perplexity within 2% of the float32 cache's (had the read not multiplied them back,
    attention would change wholesale). The Triton kernels (interpreted on CPU: store, chunked
    prefill reading the cache, split decode) give the reference backend's prompt logprobs and greedy
    tokens on the same scaled fp8 cache."""
    import math
    tensors = {}
    for i in range(4):
        names = (("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale") if i % 2
                 else ("self_attn.k_scale", "self_attn.v_scale"))
        tensors[f"model.layers.{i}.{names[0]}"] = torch.tensor(4.0)
        tensors[f"model.layers.{i}.{names[1]}"] = torch.tensor([0.25])
    path = demo_with_kv_scales(tmp_path, tensors)
    results = {}
    for kv, backend in (("auto", "torch"), ("fp8", "torch"), ("fp8", "triton")):
        llm = LLM(path, kv_cache_dtype=kv, attention_backend=backend, kvcache_block_size=16,
                  max_num_batched_tokens=64, max_model_len=256, cpu_kvcache_space=0.01,
                  device="cpu")
        try:
            layers = llm.model_runner.attention_layers
            assert [(a.k_scale, a.v_scale) for a in layers] == [(4.0, 0.25)] * 4
            prompts = heldout_prompts(llm.get_tokenizer(), 2, 120)
            outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)
            logprobs = [e[t] for o in outs
                        for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
            greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True, logprobs=1),
                                  use_tqdm=False)
            results[kv, backend] = (logprobs, [o.outputs[0] for o in greedy])
        finally:
            llm.exit()
    ppl = {key: math.exp(-sum(lp) / len(lp)) for key, (lp, _) in results.items()}
    assert (abs(ppl["fp8", "torch"] / ppl["auto", "torch"] - 1) < 0.02
            and ppl["fp8", "torch"] != ppl["auto", "torch"])
    (ref_lp, ref_out), (lp, out) = results["fp8", "torch"], results["fp8", "triton"]
    assert max(abs(a - b) for a, b in zip(ref_lp, lp)) < 1e-3
    for want, got in zip(ref_out, out):   # greedy, up to a near-tie of the reference
        for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)):
            if a != b:
                top2 = sorted(want.logprobs[i].values(), key=lambda e: -e.logprob)[:2]
                assert len(top2) == 2 and top2[0].logprob - top2[1].logprob < 1e-3
                break


@pytest.mark.parametrize("tensor,error", [("model.layers.0.self_attn.k_scale", None),
                                          ("model.layers.1.self_attn.kv_scale", None),
                                          ("model.layers.0.self_attn.q_scale", None),
                                          ("model.layers.0.self_attn.k_scale", "positive finite"),
                                          ("model.layers.0.self_attn.v_scale", "per-tensor"),
                                          ("model.layers.9.self_attn.k_scale",
                                           "matches no parameter")])
def test_kv_scale_tensors(tmp_path, tensor, error):
    """kv_scale (older checkpoints) sets both scales; q_scale is skipped; a scale that is not one
    positive finite value, or of a layer the model lacks, is refused naming the tensor."""
    value = {"positive finite": torch.tensor(-1.0),
             "per-tensor": torch.ones(2)}.get(error, torch.tensor(3.0))
    path = demo_with_kv_scales(tmp_path, {tensor: value})
    if error:
        with pytest.raises(ValueError, match=f"{tensor}.*{error}|{error}.*{tensor}|{tensor!r}"):
            LLM(path, kv_cache_dtype="fp8", device="cpu", enforce_eager=True)
        return
    llm = LLM(path, kv_cache_dtype="fp8", device="cpu", cpu_kvcache_space=0.01)
    try:
        scales = [(a.k_scale, a.v_scale) for a in llm.model_runner.attention_layers]
    finally:
        llm.exit()
    want = {"k_scale": [(3.0, 1.0)] + [(1.0, 1.0)] * 3,
            "kv_scale": [(1.0, 1.0), (3.0, 3.0)] + [(1.0, 1.0)] * 2,
            "q_scale": [(1.0, 1.0)] * 4}[tensor.rsplit(".", 1)[1]]
    assert scales == want
