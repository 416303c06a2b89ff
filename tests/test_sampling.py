"""vLLM's sampling parameters and offline API: each stage against a plain reference, then end to end."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import ENGINE, assert_matches_oracle, assert_no_leaks, random_prompts

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.layers.sampler import Sampler, SamplingBatch, apply_min_p, apply_penalties, apply_top_k_top_p
from nanovllm.utils.context import get_context


# ---- the sampler's stages against hand-written references --------------------------------------
def test_top_k_top_p_masks_by_hand():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0],
                           [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 5, 5]), torch.tensor([1.0, 0.5, 0.7]))
    kept = torch.isfinite(out)
    # row 0: top-2 = tokens 0 and 2; row 1: p=0.5 of a uniform 5 -> 3 tokens (mass before the 3rd is 0.4);
    # row 2: softmax [.636, .234, .086, ...]: mass before token 1 is .636 < .7, before token 2 is .87 -> 2 tokens
    assert kept.tolist() == [[True, False, True, False, False], [True, True, True, False, False],
                             [True, True, False, False, False]]
    assert torch.equal(out[kept], logits[kept])


def test_prompt_logprobs_by_hand_and_in_slices():
    from nanovllm.layers.sampler import prompt_logprobs
    logits = torch.randn(7, 11, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows, targets = torch.tensor([0, 2, 3, 4, 6]), torch.tensor([5, 0, 10, 5, 1])
    target, top_ids, top_values = prompt_logprobs(logits, rows, targets, 3)
    ref = torch.log_softmax(logits.float(), dim=-1)[rows]
    assert torch.allclose(target, ref.gather(1, targets[:, None]).squeeze(1))
    assert torch.equal(top_ids, ref.topk(3).indices) and torch.allclose(top_values, ref.topk(3).values)
    sliced = prompt_logprobs(logits, rows, targets, 3, slice_rows=2)  # 2 + 2 + 1 rows
    assert all(torch.equal(a, b) for a, b in zip(sliced, (target, top_ids, top_values)))
    assert prompt_logprobs(logits, rows, targets, 0)[1].shape == (5, 1)  # k = 0: one top entry, cut on the host


def test_min_p_mask_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(apply_min_p(logits, torch.tensor([0.25]))).tolist()
    assert kept == [[True, True, True, False]]  # threshold 0.25 * 0.5 = 0.125


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    torch.manual_seed(0)
    logits = torch.randn(2, 20)
    history = torch.tensor([[1, 5, 5, 7], [0, 2, 19, 19]])  # prompt + output tokens
    ref = RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    b = SamplingBatch(torch.ones(2), presence_penalty=torch.zeros(2), frequency_penalty=torch.zeros(2),
                      repetition_penalty=torch.full((2,), 1.3), prompt_ids=history[:, :2], output_ids=history[:, 2:])
    assert torch.allclose(apply_penalties(logits, b), ref)


def test_presence_and_frequency_penalties_by_hand():
    torch.manual_seed(1)
    logits = torch.randn(2, 10)
    outputs = [[3, 3, 4], [9]]
    b = SamplingBatch(torch.ones(2), presence_penalty=torch.tensor([0.5, -0.2]),
                      frequency_penalty=torch.tensor([0.25, 1.0]), repetition_penalty=torch.ones(2),
                      prompt_ids=torch.tensor([[10, 10], [1, 10]]), output_ids=torch.tensor([[3, 3, 4], [9, 10, 10]]))
    expected = logits.clone()
    for row, toks in enumerate(outputs):
        for t in set(toks):
            count = toks.count(t)
            expected[row, t] -= b.frequency_penalty[row] * count + b.presence_penalty[row]
    assert torch.allclose(apply_penalties(logits, b), expected)


@pytest.mark.parametrize("top_k, top_p, min_p", [(3, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (4, 0.9, 0.05)])
def test_sampled_distribution_after_truncation(top_k, top_p, min_p):
    """100k draws: frequencies within 5 standard errors (and 0.01) of the truncated, renormalized
    softmax(logits / T) computed by hand."""
    torch.manual_seed(2)
    logits = torch.randn(8) * 1.5
    temperature, n = 0.8, 100_000
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(8, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[i] = True
        mass += float(probs[i])
    keep &= probs >= min_p * probs.max()
    target = torch.where(keep, probs, 0.0)
    target /= target.sum()
    b = SamplingBatch(torch.full((n,), temperature), top_k=torch.full((n,), top_k or 8),
                      top_p=torch.full((n,), top_p), min_p=torch.full((n,), min_p))
    draws, _ = Sampler()(logits.expand(n, 8), b, torch.Generator().manual_seed(3))
    freq = torch.bincount(draws, minlength=8).double() / n
    stderr = (target * (1 - target) / n).sqrt()
    assert ((freq - target).abs() <= 5 * stderr + 1e-12).all() and (freq - target).abs().max() < 0.01, (freq, target)


def test_incremental_detokenizer_holds_back_split_characters(tiny):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    text = "héllo wörld, 你好 🙂!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    detok = IncrementalDetokenizer(tokenizer, [72, 105])
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text
    assert deltas.count("") >= len(ids) - len(text)


def test_invalid_sampling_params_name_field_and_value():
    for kwargs, match in [(dict(top_p=0), "top_p must be in"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
                          (dict(min_p=2), "min_p"), (dict(n=0), "n must be"), (dict(seed=-1), "seed"),
                          (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition"),
                          (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[""]), "stop"),
                          (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(logprobs=-1), "logprobs"),
                          (dict(prompt_logprobs=-1), "prompt_logprobs must be >= 0, got -1"),
                          (dict(prompt_logprobs=1.5), "prompt_logprobs must be an int, got 1.5"),
                          (dict(prompt_logprobs=True), "prompt_logprobs must be an int")]:
        with pytest.raises((ValueError, TypeError), match=match):
            SamplingParams(**kwargs)


# ---- end to end ---------------------------------------------------------------------------------
def test_output_fields(llm, oracle, tiny):
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")  # 44 tokens
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out["token_ids"] == oracle.greedy(tiny, prompt, 6)[0]
    assert out["finish_reason"] == "length" and out["prompt_token_ids"] == prompt
    assert out["outputs"] == [{"text": out["text"], "token_ids": out["token_ids"], "finish_reason": "length"}]
    assert 0 < out["metrics"]["time_to_first_token"] <= out["metrics"]["total_time"]
    again = llm.generate([{"prompt": "The quick brown fox jumps over the lazy dog."}],
                         SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert again["token_ids"] == out["token_ids"] and again["num_cached_tokens"] == 32  # two full blocks hit


def test_logprobs_are_the_raw_distribution(llm, oracle, tiny):
    prompt = random_prompts(1, 20, 20, seed=41)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True, logprobs=3,
                                                repetition_penalty=1.5), use_tqdm=False)[0]
    assert len(out["logprobs"]) == 5
    model = oracle.model(tiny)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out["token_ids"]])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.double(), -1)
    for pos, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
        top3 = ref[pos].topk(3).indices.tolist()
        assert set(entry) == set(top3) | {token}
        for t, lp in entry.items():
            assert lp == pytest.approx(float(ref[pos, t]), abs=1e-4)


def test_stop_strings_across_token_boundaries(llm, oracle, tiny):
    prompt = random_prompts(1, 10, 10, seed=42)[0]
    ref_ids = oracle.greedy(tiny, prompt, 60)[0]
    ref_text = llm.tokenizer.decode(ref_ids, skip_special_tokens=True)
    # the byte tokenizer: three consecutive ASCII tokens make a three-token stop string
    start = next(i for i in range(3, 57) if all(t < 128 for t in ref_ids[i:i + 3]))
    stop = bytes(ref_ids[start:start + 3]).decode()
    cut_at = ref_text.find(stop)
    for include in (False, True):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[stop, "zzz"],
                                                    include_stop_str_in_output=include), use_tqdm=False)[0]
        assert out["finish_reason"] == "stop"
        assert out["text"] == ref_text[:cut_at + (len(stop) if include else 0)]
        assert out["token_ids"] == ref_ids[:len(out["token_ids"])] and len(out["token_ids"]) <= start + 3


def test_stop_token_ids_and_min_tokens(llm, oracle, tiny):
    prompt = random_prompts(1, 12, 12, seed=43)[0]
    ref = oracle.greedy(tiny, prompt, 20)[0]
    stop_id = ref[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    assert out["token_ids"] == ref[:ref.index(stop_id) + 1] and out["finish_reason"] == "stop"
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id],
                                                 min_tokens=8), use_tqdm=False)[0]
    assert stop_id not in late["token_ids"][:8] and len(late["token_ids"]) >= 8


def test_seeds_reproducible_across_batch_mixes(llm):
    prompt = random_prompts(1, 25, 25, seed=44)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=1234)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    others = random_prompts(5, 5, 60, seed=45)
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 2 + [seeded] +
                         [SamplingParams(temperature=0.5, top_k=5, max_tokens=9, seed=9, ignore_eos=True)] * 3,
                         use_tqdm=False)[2]["token_ids"]
    assert mixed == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True,
                                                       seed=4321), use_tqdm=False)[0]["token_ids"]
    assert other_seed != alone


def test_n_completions_share_the_prompt_blocks(llm):
    prompt = random_prompts(1, 70, 70, seed=46)[0]  # 4 full blocks of 16, then 6 tokens
    hits = llm.scheduler.block_manager.num_cache_hits
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert llm.scheduler.block_manager.num_cache_hits - hits >= 3 * 4  # completions 1-3 reuse all 4 full blocks
    assert len(out["outputs"]) == 4 and out["token_ids"] == out["outputs"][0]["token_ids"]
    assert len({tuple(o["token_ids"]) for o in out["outputs"]}) > 1
    greedy = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len({tuple(o["token_ids"]) for o in greedy["outputs"]}) == 1
    assert_no_leaks(llm)


def test_stream_yields_the_generated_text(llm):
    prompts = ["Hello", "streaming works"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    final = llm.generate(prompts, sp, use_tqdm=False)
    pieces: dict[int, list[str]] = {0: [], 1: []}
    finished = []
    for chunk in llm.stream(prompts, sp):
        pieces[chunk["index"]].append(chunk["text"])
        if chunk["finished"]:
            finished.append((chunk["index"], chunk["finish_reason"]))
    assert sorted(finished) == [(0, "length"), (1, "length")]
    for i in (0, 1):
        assert "".join(pieces[i]) == final[i]["text"]
    assert llm.is_finished() and not llm.requests


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hi there"}]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.chat(messages, sp, use_tqdm=False)
    ids = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = llm.generate([ids], sp, use_tqdm=False)
    assert out[0]["token_ids"] == ref[0]["token_ids"]
    assert len(llm.chat([messages, messages], sp, use_tqdm=False)) == 2


def test_vllm_engine_keywords(tiny):
    engine = LLM(tiny, block_size=16, enable_prefix_caching=False, max_model_len=256, num_kvcache_blocks=64, seed=3)
    try:
        assert engine.config.kvcache_block_size == 16
        prompt = list(range(40))
        engine.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
        engine.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
        assert engine.scheduler.block_manager.num_cache_hits == 0
    finally:
        engine.exit()
    with pytest.raises(TypeError, match="not both"):
        LLM(tiny, block_size=16, kvcache_block_size=16)


def test_skip_tokenizer_init_rejects_text(tiny, tmp_path):
    ckpt = tmp_path / "notok"
    shutil.copytree(tiny, ckpt, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    engine = LLM(str(ckpt), skip_tokenizer_init=True, **ENGINE)
    try:
        out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
        assert out["text"] == "" and len(out["token_ids"]) == 3
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            engine.generate(["text"], SamplingParams(), use_tqdm=False)
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            engine.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    finally:
        engine.exit()


# ---- prompt logprobs ----------------------------------------------------------------------------
def assert_prompt_logprobs(model, prompt: list[int], entries: list, k: int, tol: float = 1e-4):
    """vLLM's format (None for the first token, then {token id: logprob} of the actual token and the
    top k) with transformers' log_softmax of the full sequence's logits (float32) as the reference."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        entry, expected = entries[pos], ref[pos - 1]
        assert prompt[pos] in entry and len(entry) in (k, k + 1), (pos, entry)
        kth = float(expected.topk(k).values[-1]) if k else float("inf")
        for t, lp in entry.items():
            assert lp == pytest.approx(float(expected[t]), abs=tol), (pos, t)
            assert t == prompt[pos] or lp >= kth - tol, f"position {pos}: {t} is not in the top {k}"


def _prompt_logprobs_workload():
    """Asking and plain requests mixed: a prompt that is in the prefix cache (asked for and not),
    top-k from 0 to 5, a one-token prompt, n=2, sampled-token logprobs beside prompt logprobs."""
    shared = random_prompts(1, 50, 50, seed=51)[0]  # 3 full blocks of 16 in the cache after a first run
    prompts = [shared, shared] + random_prompts(5, 2, 70, seed=52) + [[7]]
    g = dict(temperature=0, max_tokens=12, ignore_eos=True)
    params = [SamplingParams(**g, prompt_logprobs=3), SamplingParams(**g), SamplingParams(**g, prompt_logprobs=0),
              SamplingParams(**g), SamplingParams(**g, prompt_logprobs=2, n=2),
              SamplingParams(**g, prompt_logprobs=1, logprobs=2), SamplingParams(**g, prompt_logprobs=5),
              SamplingParams(**g, prompt_logprobs=4)]
    return shared, prompts, params


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("engine", ["plain", "chunked", "chunked_preempted"])
def test_prompt_logprobs_match_transformers(tiny, oracle, async_scheduling, engine):
    kw = {"plain": {}, "chunked": dict(max_num_batched_tokens=7),  # chunks shorter than a block
          "chunked_preempted": dict(max_num_batched_tokens=40, num_kvcache_blocks=8)}[engine]  # 128 slots
    shared, prompts, params = _prompt_logprobs_workload()
    llm = LLM(tiny, **{**ENGINE, **kw}, async_scheduling=async_scheduling)
    preempted = []
    original_preempt = llm.scheduler.preempt

    def spy(seq):
        preempted.append(seq.sampling_params.prompt_logprobs is not None)
        original_preempt(seq)

    llm.scheduler.preempt = spy
    try:
        llm.generate([shared], SamplingParams(max_tokens=2), use_tqdm=False)  # the prefix cache holds it now
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    if engine == "chunked_preempted":
        assert any(preempted), "the small cache should have preempted a request with prompt logprobs"
    assert_matches_oracle(oracle, tiny, prompts, outputs, 12)
    assert outputs[0]["num_cached_tokens"] == 0, "prompt logprobs must not come from the prefix cache"
    assert outputs[1]["num_cached_tokens"] == 48, "a plain request still hits the prefix cache"
    model = oracle.model(tiny)
    for prompt, sp, out in zip(prompts, params, outputs):
        if sp.prompt_logprobs is None:
            assert "prompt_logprobs" not in out
        else:
            assert_prompt_logprobs(model, prompt, out["prompt_logprobs"], sp.prompt_logprobs)
    assert outputs[7]["prompt_logprobs"] == [None]  # a one-token prompt has no logprob to give
    assert len(outputs[4]["outputs"]) == 2 and all(len(e) <= 3 for e in outputs[4]["prompt_logprobs"][1:])
    assert len(outputs[5]["logprobs"]) == 12


def test_prompt_logprobs_only_widen_the_batches_that_ask(llm):
    """A prefill without prompt logprobs projects each sequence's last position only; one with them
    projects every position of the sequences that ask, and the last of the others."""
    calls = []

    def hook(module, args, logits):
        context = get_context()
        if context.is_prefill:
            calls.append((logits.size(0), context.cu_seqlens_q.numel() - 1))

    handle = llm.model_runner.model.lm_head.register_forward_hook(hook)
    prompts = random_prompts(3, 20, 30, seed=53)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
        assert calls and all(rows == num_seqs for rows, num_seqs in calls)
        calls.clear()
        llm.generate(prompts, [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, prompt_logprobs=1),
                               SamplingParams(max_tokens=2)], use_tqdm=False)
    finally:
        handle.remove()
    assert calls == [(1 + len(prompts[1]) + 1, 3)]


def test_prompt_logprobs_tensor_parallel(checkpoints, oracle):
    path = checkpoints["gqa4_hd128_sharded"]
    prompts = random_prompts(3, 10, 60, seed=54)
    llm = LLM(path, **ENGINE, tensor_parallel_size=2, device="cpu", max_num_batched_tokens=32)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2),
                               use_tqdm=False)
    finally:
        llm.exit()
    for prompt, out in zip(prompts, outputs):
        assert_prompt_logprobs(oracle.model(path), prompt, out["prompt_logprobs"], 2)
