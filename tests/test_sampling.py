"""Specification of SamplingParams and the sampler: each sampling stage against a plain reference
(temperature, top-k/top-p, min-p, penalties, the sampled distribution), logprobs and prompt
logprobs, seeds, stop conditions (EOS ids, stop ids and strings, min_tokens, max_model_len), and
SamplingParams' validation, fields assigned after construction included."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import (
    ENGINE,
    GREEDY,
    assert_matches_oracle,
    assert_no_leaks,
    assert_prompt_logprobs,
    random_prompts,
    token_ids_of,
)

from nanovllm import LLM, Logprob, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.layers.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)
from nanovllm.utils.context import get_context


# ---- the sampler's stages against hand-written references ----------------------------------------
def test_top_k_top_p_masks_by_hand():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0],
                           [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 5, 5]), torch.tensor([1.0, 0.5, 0.7]))
    kept = torch.isfinite(out)
    # row 0: top-2 = tokens 0 and 2; row 1: p=0.5 of a uniform 5 -> 3 tokens (mass before the 3rd is
    # 0.4); row 2: softmax [.636, .234, .086, ...]: mass before token 1 is .636 < .7, before token 2
    # is .87 -> 2 tokens
    assert kept.tolist() == [[True, False, True, False, False], [True, True, True, False, False],
                             [True, True, False, False, False]]
    assert torch.equal(out[kept], logits[kept])


def test_prompt_logprobs_by_hand_and_in_slices():
    from nanovllm.engine.logprobs import prompt_logprobs
    logits = torch.randn(7, 11, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows, targets = torch.tensor([0, 2, 3, 4, 6]), torch.tensor([5, 0, 10, 5, 1])
    target, ranks, top_ids, top_values = prompt_logprobs(logits, rows, targets, 3)
    ref = torch.log_softmax(logits.float(), dim=-1)[rows]
    assert torch.allclose(target, ref.gather(1, targets[:, None]).squeeze(1))
    # rank: 1 + how many tokens are more likely (vLLM's), from a sort of the whole row
    order = ref.argsort(dim=-1, descending=True)
    assert ranks.tolist() == [1 + order[i].tolist().index(int(t)) for i, t in enumerate(targets)]
    assert (torch.equal(top_ids, ref.topk(3).indices)
            and torch.allclose(top_values, ref.topk(3).values))
    sliced = prompt_logprobs(logits, rows, targets, 3, slice_rows=2)  # 2 + 2 + 1 rows
    assert all(torch.equal(a, b) for a, b in zip(sliced, (target, ranks, top_ids, top_values)))
    # k = 0: one top entry, cut on the host
    assert prompt_logprobs(logits, rows, targets, 0)[2].shape == (5, 1)


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
    b = SamplingBatch(torch.ones(2), presence_penalty=torch.zeros(2),
                      frequency_penalty=torch.zeros(2), repetition_penalty=torch.full((2,), 1.3),
                      prompt_ids=history[:, :2], output_ids=history[:, 2:])
    assert torch.allclose(apply_penalties(logits, b), ref)


def test_presence_and_frequency_penalties_by_hand():
    torch.manual_seed(1)
    logits = torch.randn(2, 10)
    outputs = [[3, 3, 4], [9]]
    b = SamplingBatch(torch.ones(2), presence_penalty=torch.tensor([0.5, -0.2]),
                      frequency_penalty=torch.tensor([0.25, 1.0]), repetition_penalty=torch.ones(2),
                      prompt_ids=torch.tensor([[10, 10], [1, 10]]),
                      output_ids=torch.tensor([[3, 3, 4], [9, 10, 10]]))
    expected = logits.clone()
    for row, toks in enumerate(outputs):
        for t in set(toks):
            count = toks.count(t)
            expected[row, t] -= b.frequency_penalty[row] * count + b.presence_penalty[row]
    assert torch.allclose(apply_penalties(logits, b), expected)


def test_sampler_greedy_rows():
    logits = torch.randn(4, 50)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7])
    out, _ = Sampler()(logits, SamplingBatch(temps), torch.Generator().manual_seed(0))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_sampler_distribution_matches_softmax():
    """200k draws on an 8-token vocabulary: every empirical frequency within 5 standard
    errors (and 0.01 absolute) of softmax(logits / T)."""
    torch.manual_seed(0)
    logits = torch.randn(8) * 2
    for temperature in (0.5, 1.0, 1.7):
        n = 200_000
        draws, _ = Sampler()(logits.expand(n, 8), SamplingBatch(torch.full((n,), temperature)),
                             torch.Generator().manual_seed(1))
        freq = torch.bincount(draws, minlength=8).double() / n
        p = torch.softmax(logits.double() / temperature, -1)
        stderr = (p * (1 - p) / n).sqrt()
        assert (((freq - p).abs() <= 5 * stderr + 1e-12).all()
                and (freq - p).abs().max() < 0.01), (freq, p)


@pytest.mark.parametrize("top_k, top_p, min_p",
                         [(3, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (4, 0.9, 0.05)])
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
    assert (((freq - target).abs() <= 5 * stderr + 1e-12).all()
            and (freq - target).abs().max() < 0.01), (freq, target)


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


# ---- SamplingParams' validation ------------------------------------------------------------------
def test_invalid_sampling_params_name_field_and_value():
    for kwargs, match in [(dict(top_p=0), "top_p must be in"), (dict(top_p=1.5), "top_p"),
                          (dict(top_k=-2), "top_k"), (dict(min_p=2), "min_p"),
                          (dict(n=0), "n must be"), (dict(seed=-1), "seed"),
                          (dict(presence_penalty=3), "presence_penalty"),
                          (dict(repetition_penalty=0), "repetition"),
                          (dict(min_tokens=5, max_tokens=2), "min_tokens"),
                          (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
                          (dict(logprobs=-1), "logprobs"),
                          (dict(prompt_logprobs=-1), "prompt_logprobs must be >= 0, got -1"),
                          (dict(prompt_logprobs=1.5), "prompt_logprobs must be an int, got 1.5"),
                          (dict(seed=True), "seed must be an int")]:
        with pytest.raises((ValueError, TypeError), match=match):
            SamplingParams(**kwargs)
    # vLLM takes a bool as the int it is (its tests pass prompt_logprobs=True)
    assert SamplingParams(prompt_logprobs=True, logprobs=False).prompt_logprobs == 1
    assert SamplingParams(logprobs=False).logprobs == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature="hot"), "temperature"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


def test_bad_values_never_reach_a_step(llm):
    vocab = llm.config.hf_config.vocab_size
    with pytest.raises(ValueError, match=r"stop_token_ids \[100000\] are outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[100000], min_tokens=2),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="seed must be"):
        SamplingParams(seed=2 ** 64)
    with pytest.raises(TypeError, match="stop must be a string or a list of strings, got 5"):
        SamplingParams(stop=5)
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    with pytest.raises(ValueError, match=r"keys \['multi_modal_data'\]"):
        llm.generate([{"prompt_token_ids": [1, 2], "multi_modal_data": {}}], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt_token_ids must be a list of ints, got 'abc'"):
        llm.generate([{"prompt_token_ids": "abc"}], use_tqdm=False)  # was tokenized as text
    with pytest.raises(TypeError, match="messages must be a conversation"):
        llm.chat("hello", use_tqdm=False)
    # the largest seed, and its sibling's (seed + 1 wraps to 0), run and repeat
    sp = SamplingParams(n=2, seed=2 ** 64 - 1, temperature=1.0, max_tokens=5, ignore_eos=True)
    a, b = (llm.generate([[3, 4, 5]], sp, use_tqdm=False)[0]["outputs"] for _ in range(2))
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]
    # a tiny temperature is greedy, not NaN
    prompts = random_prompts(3, 5, 20, seed=72)
    tiny_t = SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True)
    assert token_ids_of(llm.generate(prompts, tiny_t, use_tqdm=False)) == \
        token_ids_of(llm.generate(prompts, GREEDY, use_tqdm=False))
    # still usable
    assert llm.generate([[vocab - 1]], GREEDY, use_tqdm=False)[0]["finish_reason"] == "length"


# ---- end to end: logprobs, stop conditions, seeds ------------------------------------------------
def test_logprobs_are_the_raw_distribution(llm, oracle, tiny):
    prompt = random_prompts(1, 20, 20, seed=41)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True,
                                                logprobs=3, repetition_penalty=1.5),
                       use_tqdm=False)[0]
    assert len(out["logprobs"]) == 5
    model = oracle.model(tiny)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out["token_ids"]])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.double(), -1)
    for pos, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
        top3 = ref[pos].topk(3).indices.tolist()
        # the chosen token first
        assert set(entry) == set(top3) | {token} and next(iter(entry)) == token
        order = ref[pos].argsort(descending=True).tolist()
        # vLLM's Logprob: a float too, its rank in the whole vocabulary, its text
        for t, lp in entry.items():
            assert isinstance(lp, Logprob) and lp.logprob == float(lp)
            assert lp == pytest.approx(float(ref[pos, t]), abs=1e-4)
            assert lp.rank == 1 + order.index(t) and lp.decoded_token == llm.tokenizer.decode([t])
    chosen = [float(ref[pos, t]) for pos, t in enumerate(out["token_ids"])]
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)


def test_stop_strings_across_token_boundaries(llm, oracle, tiny):
    prompt = random_prompts(1, 10, 10, seed=42)[0]
    ref_ids = oracle.greedy(tiny, prompt, 60)[0]
    ref_text = llm.tokenizer.decode(ref_ids, skip_special_tokens=True)
    # the byte tokenizer: three consecutive ASCII tokens make a three-token stop string
    start = next(i for i in range(3, 57) if all(t < 128 for t in ref_ids[i:i + 3]))
    stop = bytes(ref_ids[start:start + 3]).decode()
    cut_at = ref_text.find(stop)
    for include in (False, True):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                                    stop=[stop, "zzz"],
                                                    include_stop_str_in_output=include),
                           use_tqdm=False)[0]
        assert out["finish_reason"] == "stop"
        assert out["text"] == ref_text[:cut_at + (len(stop) if include else 0)]
        assert (out["token_ids"] == ref_ids[:len(out["token_ids"])]
                and len(out["token_ids"]) <= start + 3)


def test_stop_token_ids_and_min_tokens(llm, oracle, tiny):
    prompt = random_prompts(1, 12, 12, seed=43)[0]
    ref = oracle.greedy(tiny, prompt, 20)[0]
    stop_id = ref[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    assert out["token_ids"] == ref[:ref.index(stop_id) + 1] and out["finish_reason"] == "stop"
    capped = llm.generate([prompt],
                          SamplingParams(temperature=0, max_tokens=ref.index(stop_id) + 1,
                                         stop_token_ids=[stop_id]), use_tqdm=False)[0]
    # vLLM: length first
    assert capped["token_ids"] == out["token_ids"] and capped["finish_reason"] == "length"
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                 stop_token_ids=[stop_id], min_tokens=8),
                        use_tqdm=False)[0]
    assert stop_id not in late["token_ids"][:8] and len(late["token_ids"]) >= 8


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
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=32),
                              use_tqdm=False)[0]
        ignored = engine.generate([prompt],
                                  SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                  use_tqdm=False)[0]
    finally:
        engine.exit()
    assert out["token_ids"] == ref[:ref.index(stop_token) + 1]
    assert ignored["token_ids"] == ref
    # generation_config's EOS ids other than the model's own are stop tokens to vLLM: named by
    # stop_reason
    assert (out.outputs[0].stop_reason == stop_token
            and engine.config.eos_token_ids[0] == engine.tokenizer.eos_token_id)


def test_stops_at_max_model_len(tiny):
    engine = LLM(tiny, kvcache_block_size=16, max_model_len=40, num_kvcache_blocks=64)
    try:
        out = engine.generate([list(range(30))],
                              SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                              use_tqdm=False)[0]
    finally:
        engine.exit()
    assert len(out["token_ids"]) == 10 and out["finish_reason"] == "length"


def test_seeds_reproducible_across_batch_mixes(llm):
    prompt = random_prompts(1, 25, 25, seed=44)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=1234)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    others = random_prompts(5, 5, 60, seed=45)
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 2 +
                         [seeded] + [SamplingParams(temperature=0.5, top_k=5, max_tokens=9, seed=9,
                                                    ignore_eos=True)] * 3,
                         use_tqdm=False)[2]["token_ids"]
    assert mixed == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16,
                                                       ignore_eos=True, seed=4321),
                              use_tqdm=False)[0]["token_ids"]
    assert other_seed != alone


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


# ---- SamplingParams fields assigned after construction -------------------------------------------
def test_assigned_fields_are_honoured(llm):
    prompts = random_prompts(4, 5, 30, seed=70)
    greedy = token_ids_of(llm.generate(prompts, GREEDY, use_tqdm=False))

    top_k = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    # as vLLM's own examples do: sp = llm.get_default_sampling_params(); sp.top_k = ...
    top_k.top_k = 1
    assert token_ids_of(llm.generate(prompts, top_k, use_tqdm=False)) == greedy

    seeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    seeded.seed = 7
    first = token_ids_of(llm.generate(prompts, seeded, use_tqdm=False))
    # moves the engine's RNG
    llm.generate(random_prompts(3, 5, 9, seed=71), SamplingParams(temperature=1.0), use_tqdm=False)
    assert token_ids_of(llm.generate(prompts, seeded, use_tqdm=False)) == first

    logprobs = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    logprobs.logprobs = 2
    out = llm.generate(prompts[:1], logprobs, use_tqdm=False)[0]
    assert len(out["logprobs"]) == 3 and all(len(entry) >= 2 for entry in out["logprobs"])

    stop_id = greedy[0][2]
    late = SamplingParams(temperature=0, max_tokens=8)
    late.stop_token_ids, late.min_tokens = [stop_id], 4
    out = llm.generate(prompts[:1], late, use_tqdm=False)[0]
    assert stop_id not in out["token_ids"][:4] and len(out["token_ids"]) >= 4


def test_assigned_stop_string_stops(llm):
    prompt = random_prompts(1, 10, 10, seed=42)[0]
    ref_ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                           use_tqdm=False)[0]["token_ids"]
    start = next(i for i in range(3, 57) if all(t < 128 for t in ref_ids[i:i + 3]))
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    sp.stop = bytes(ref_ids[start:start + 3]).decode()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and len(out["token_ids"]) <= start + 3


def test_assigned_bad_values_are_refused_at_admission(llm):
    for field, value, error in [("temperature", -1, ValueError), ("top_p", 0.0, ValueError),
                                ("stop", 5, TypeError), ("seed", 2 ** 64, ValueError),
                                ("n", 0, ValueError)]:
        sp = SamplingParams(max_tokens=2)
        setattr(sp, field, value)
        with pytest.raises(error, match=field):
            llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    assert not llm.requests and llm.is_finished()  # nothing was admitted


def test_admitted_params_are_a_copy(llm):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.add_request([1, 2, 3], sp)
    sp.max_tokens = 1  # after admission: the running request keeps what it was admitted with
    done = []
    while llm.has_unfinished_requests():
        done += [out for out in llm.step() if out.finished]
    assert [len(out["token_ids"]) for out in done] == [6]


# ---- prompt logprobs -----------------------------------------------------------------------------
def _prompt_logprobs_workload():
    """Asking and plain requests mixed: a prompt that is in the prefix cache (asked for and not),
    top-k from 0 to 5, a one-token prompt, n=2, sampled-token logprobs beside prompt logprobs."""
    # 3 full blocks of 16 in the cache after a first run
    shared = random_prompts(1, 50, 50, seed=51)[0]
    prompts = [shared, shared] + random_prompts(5, 2, 70, seed=52) + [[7]]
    g = dict(temperature=0, max_tokens=12, ignore_eos=True)
    params = [SamplingParams(**g, prompt_logprobs=3), SamplingParams(**g),
              SamplingParams(**g, prompt_logprobs=0), SamplingParams(**g),
              SamplingParams(**g, prompt_logprobs=2, n=2),
              SamplingParams(**g, prompt_logprobs=1, logprobs=2),
              SamplingParams(**g, prompt_logprobs=5), SamplingParams(**g, prompt_logprobs=4)]
    return shared, prompts, params


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("engine", ["plain", "chunked", "chunked_preempted"])
def test_prompt_logprobs_match_transformers(tiny, oracle, async_scheduling, engine):
    kw = {"plain": {}, "chunked": dict(max_num_batched_tokens=7),  # chunks shorter than a block
          "chunked_preempted": dict(max_num_batched_tokens=40,
                                    num_kvcache_blocks=8)}[engine]  # 128 slots
    shared, prompts, params = _prompt_logprobs_workload()
    llm = LLM(tiny, **{**ENGINE, **kw}, async_scheduling=async_scheduling)
    preempted = []
    original_preempt = llm.scheduler.preempt

    def spy(seq):
        preempted.append(seq.sampling_params.prompt_logprobs is not None)
        original_preempt(seq)

    llm.scheduler.preempt = spy
    try:
        # the prefix cache holds it now
        llm.generate([shared], SamplingParams(max_tokens=2), use_tqdm=False)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    if engine == "chunked_preempted":
        assert any(preempted), ("the small cache should have preempted a request with prompt "
                                "logprobs")
    assert_matches_oracle(oracle, tiny, prompts, outputs, 12)
    assert outputs[0]["num_cached_tokens"] == 0, ("prompt logprobs must not come from the prefix "
                                                  "cache")
    assert outputs[1]["num_cached_tokens"] == 48, "a plain request still hits the prefix cache"
    model = oracle.model(tiny)
    for prompt, sp, out in zip(prompts, params, outputs):
        if sp.prompt_logprobs is None:
            assert "prompt_logprobs" not in out
        else:
            assert_prompt_logprobs(model, prompt, out["prompt_logprobs"], sp.prompt_logprobs)
    assert outputs[7]["prompt_logprobs"] == [None]  # a one-token prompt has no logprob to give
    assert (len(outputs[4]["outputs"]) == 2
            and all(len(e) <= 3 for e in outputs[4]["prompt_logprobs"][1:]))
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
        llm.generate(prompts, [SamplingParams(max_tokens=2),
                               SamplingParams(max_tokens=2, prompt_logprobs=1),
                               SamplingParams(max_tokens=2)], use_tqdm=False)
    finally:
        handle.remove()
    assert calls == [(1 + len(prompts[1]) + 1, 3)]


def test_stop_string_order_against_length_and_min_tokens(llm, oracle, tiny):
    """vLLM's order: a stop string that the max_tokens-th token completes ends the completion as
    "stop" (not "length"); a stop string counts only once more than min_tokens tokens are out."""
    prompt = random_prompts(1, 10, 10, seed=42)[0]
    ref_ids = oracle.greedy(tiny, prompt, 60)[0]
    decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    start = next(i for i in range(3, 57) if all(t < 128 for t in ref_ids[i:i + 3]))
    stop = bytes(ref_ids[start:start + 3]).decode()
    # the token count that completes it
    k = next(k for k in range(1, 61) if stop in decode(ref_ids[:k]))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True,
                                                stop=stop), use_tqdm=False)[0]
    assert (out["finish_reason"] == "stop"
            and out["text"] == decode(ref_ids[:k])[:decode(ref_ids[:k]).find(stop)])
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                                 stop=stop, min_tokens=k), use_tqdm=False)[0]
    assert len(late["token_ids"]) > k and late["token_ids"] == ref_ids[:len(late["token_ids"])]


# ---- vLLM's output fields: detokenize, output_kind, flat_logprobs, the logprobs module -----------
def _step_until_done(engine) -> dict[str, list]:
    """Every output step() reports, by request id, until no request is unfinished."""
    reports: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
    return reports


def _same_entries(got: list, want: list) -> bool:
    """Logprobs entries alike: the same tokens, ranks and texts, and values up to a batch's
    rounding."""
    return len(got) == len(want) and all(
        (g is None) == (w is None) and list(g or {}) == list(w or {}) and
        all((lp.rank, lp.decoded_token) == (w[t].rank, w[t].decoded_token)
            and lp == pytest.approx(w[t], abs=1e-4)
            for t, lp in (g or {}).items()) for g, w in zip(got, want))


def test_detokenize_false_gives_no_text_and_never_decodes(llm, monkeypatch):
    prompts = random_prompts(2, 5, 20, seed=90)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    reference = llm.generate(prompts, sp, use_tqdm=False)
    ref_ids = reference[0]["token_ids"]
    calls = []
    for name in ("decode", "batch_decode", "convert_ids_to_tokens", "convert_tokens_to_string"):
        monkeypatch.setattr(llm.tokenizer, name, lambda *a, _name=name, **k: calls.append(_name))
    quiet = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1,
                           prompt_logprobs=1, detokenize=False)
    outs = llm.generate(prompts + ["a text prompt"], quiet, use_tqdm=False)
    llm.llm_engine.add_request("quiet", prompts[0], quiet)
    stepped = _step_until_done(llm.llm_engine)["quiet"]
    pieces = list(llm.stream(prompts[:1], quiet))
    # the detokenizer did no work: not a token decoded, for text, logprobs or a stream
    assert calls == []
    assert (token_ids_of(outs[:2]) == token_ids_of(reference)
            and stepped[-1].outputs[0].token_ids == ref_ids)
    for out in outs + stepped:
        assert (out.outputs[0].text == ""
                and len(out.outputs[0].token_ids) == len(out.outputs[0].logprobs or []))
        entries = out.outputs[0].logprobs + out.prompt_logprobs[1:]
        assert all(lp.decoded_token is None for entry in entries for lp in entry.values())  # vLLM's
    assert [p["text"] for p in pieces] == [""] * len(pieces)
    assert sum((p["token_ids"] for p in pieces), []) == ref_ids and pieces[-1]["finished"]


def test_detokenize_false_refuses_stop_strings_as_vllm(llm):
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(detokenize=False, stop=["\n"])
    for name, bad in (("detokenize", "no"), ("flat_logprobs", 1), ("output_kind", "delta")):
        with pytest.raises(TypeError, match=f"{name} must be a"):
            SamplingParams(**{name: bad})
    late = SamplingParams(max_tokens=2, stop="x")
    late.detokenize = False  # assigned after construction: refused at admission
    with pytest.raises(ValueError, match=r"Set detokenize=True to use stop \(got stop='x'"):
        llm.generate([[1, 2, 3]], late, use_tqdm=False)
    assert not llm.requests


def test_output_kind_shapes_step_outputs_and_not_generate(llm):
    from nanovllm.sampling_params import RequestOutputKind
    prompt = random_prompts(1, 10, 10, seed=42)[0]
    ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                       use_tqdm=False)[0]["token_ids"]
    start = next(i for i in range(3, 57) if all(t < 128 for t in ids[i:i + 3]))
    # a stop string spread over three steps
    base = dict(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1, prompt_logprobs=1,
                stop=[bytes(ids[start:start + 3]).decode()])
    (ref,) = llm.generate([prompt], SamplingParams(**base), use_tqdm=False)
    assert ref.outputs[0].finish_reason == "stop" and len(ref.outputs[0].token_ids) > 4
    for kind in RequestOutputKind:  # generate returns the final output, whatever the kind
        (out,) = llm.generate([prompt], SamplingParams(**base, output_kind=kind), use_tqdm=False)
        assert (out.outputs[0].text, out.outputs[0].token_ids) == (ref.outputs[0].text,
                                                                   ref.outputs[0].token_ids)
    for kind in RequestOutputKind:
        llm.llm_engine.add_request(kind.name, prompt, SamplingParams(**base, output_kind=kind))
    reports = _step_until_done(llm.llm_engine)
    (final,) = reports["FINAL_ONLY"]  # only the finished output
    assert final.finished and final.outputs[0].token_ids == ref.outputs[0].token_ids
    assert (final.outputs[0].text == ref.outputs[0].text
            and _same_entries(final.prompt_logprobs, ref.prompt_logprobs))
    cumulative, delta = reports["CUMULATIVE"], reports["DELTA"]
    assert (len(cumulative) == len(delta) > 2
            and cumulative[-1].outputs[0].text == ref.outputs[0].text)
    pieces = [d.outputs[0] for d in delta]  # only what each step added, summing to the final output
    assert "".join(p.text for p in pieces) == ref.outputs[0].text
    assert sum((p.token_ids for p in pieces), []) == ref.outputs[0].token_ids
    assert [len(p.token_ids) for p in pieces] == [len(p.logprobs) for p in pieces]
    assert _same_entries(sum((p.logprobs for p in pieces), []), ref.outputs[0].logprobs)
    assert pieces[-1].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob,
                                                          abs=1e-3)
    assert _same_entries(delta[0].prompt_logprobs, ref.prompt_logprobs)
    assert all(d.prompt_logprobs is None for d in delta[1:])
    assert [d.finished for d in delta] == [False] * (len(delta) - 1) + [True]


def test_flat_logprobs_read_as_vllms_flat_container(llm):
    from nanovllm.logprobs import FlatLogprobs, Logprob
    prompt = random_prompts(1, 12, 12, seed=91)[0]
    base = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    (ref,) = llm.generate([prompt], SamplingParams(**base), use_tqdm=False)
    (out,) = llm.generate([prompt], SamplingParams(**base, flat_logprobs=True), use_tqdm=False)
    flat, prompt_flat = out.outputs[0].logprobs, out.prompt_logprobs
    assert isinstance(flat, FlatLogprobs) and isinstance(prompt_flat, FlatLogprobs)
    assert (len(flat) == 6 and list(flat) == ref.outputs[0].logprobs
            and flat[-1] == ref.outputs[0].logprobs[-1])
    # vLLM's: {} for None
    assert prompt_flat[0] == {} and list(prompt_flat)[1:] == ref.prompt_logprobs[1:]
    for got, want in zip(flat, ref.outputs[0].logprobs):
        assert all(isinstance(lp, Logprob) for lp in got.values())
        assert [(lp.rank, lp.decoded_token) for lp in got.values()] == \
            [(w.rank, w.decoded_token) for w in want.values()]
    part = flat[2:4]  # a slice is a FlatLogprobs too, its columns indexed from 0
    assert (isinstance(part, FlatLogprobs) and list(part) == ref.outputs[0].logprobs[2:4]
            and part.start_indices[0] == 0)
    assert flat.token_ids == [t for entry in ref.outputs[0].logprobs for t in entry]
    assert flat.logprobs == [float(lp) for entry in ref.outputs[0].logprobs
                             for lp in entry.values()]
    assert out.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob)


def test_logprobs_module_is_vllms():
    import pickle

    import nanovllm
    import nanovllm.outputs
    from nanovllm.logprobs import FlatLogprobs, Logprob, PromptLogprobs, SampleLogprobs
    assert (nanovllm.Logprob is Logprob is nanovllm.outputs.Logprob
            and Logprob is globals()["Logprob"])
    lp = Logprob(logprob=-0.5, rank=2, decoded_token="a")  # vLLM's keywords
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-0.5, 2, "a")
    back = pickle.loads(pickle.dumps(lp))
    assert type(back) is Logprob and (back.logprob, back.rank, back.decoded_token) == (-0.5, 2, "a")
    assert FlatLogprobs in PromptLogprobs.__args__ and FlatLogprobs in SampleLogprobs.__args__
