"""Speculative decoding: the configuration, n-gram lookup, the rejection sampler's distribution, and
the engine's verify steps, whose outputs must be the target's token for token (preemption, chunked
prefill, prefix caching, ``n`` > 1, stops inside an accepted run, logprobs, two tensor-parallel
ranks)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.verify import VerifyEngineCore
from nanovllm.features.speculative import (
    NgramDrafter,
    Proposer,
    ngram_propose,
    parse_speculative_config,
    rejection_sample,
)
from nanovllm.layers.sampler import SamplingBatch
from tests.conftest import CPU_ENGINE, assert_matches_oracle, assert_no_leaks

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


# -- configuration ------------------------------------------------------------------------------

def test_config_defaults_and_refusals():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5,
        "prompt_lookup_max": 5}
    one = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 4})
    assert (one["prompt_lookup_min"], one["prompt_lookup_max"]) == (4, 4)
    bad = [({"method": "ngram"}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2}, "prompt_lookup_min"),
           ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "draft_tensor_parallel_size"),
           ({"model": "/some/draft", "num_speculative_tokens": 2}, "not a directory"),
           ({"model": "nanovllm:demo", "num_speculative_tokens": 2,
             "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
           ({"model": "nanovllm:demo", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
            "prompt_lookup_max"),
           ({"method": "eagle", "model": "/x", "num_speculative_tokens": 2}, "eagle"),
           ({"method": "eagle3", "model": "/x", "num_speculative_tokens": 2}, "not a directory"),
           ({"method": "medusa", "num_speculative_tokens": 2}, "medusa")]
    for config, named in bad:
        with pytest.raises(ValueError, match=named):
            parse_speculative_config(config)
    with pytest.raises(TypeError, match="dict"):
        parse_speculative_config("ngram")
    with pytest.raises(TypeError, match="prompt_lookup_max"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                  "prompt_lookup_max": "3"})


def test_engine_refuses_what_verify_steps_cannot_honour(tiny):
    with pytest.raises(ValueError, match="async_scheduling"):  # before any rank starts
        LLM(tiny, speculative_config=NGRAM, async_scheduling=True, tensor_parallel_size=2,
            **CPU_ENGINE)
    with pytest.raises(ValueError, match="logits_processors"):
        LLM(tiny, speculative_config=NGRAM, logits_processors=["builtins.object"], **CPU_ENGINE)
    llm = LLM(tiny, speculative_config=NGRAM, **CPU_ENGINE)
    try:
        assert isinstance(llm.core, VerifyEngineCore) and not llm.config.async_scheduling
        for params, named in ((SamplingParams(allowed_token_ids=[1, 2]), "allowed_token_ids"),
                              (SamplingParams(bad_words=["ab"]), "bad_words")):
            with pytest.raises(ValueError, match=named):
                llm.generate([[1, 2, 3]], params, use_tqdm=False)
        assert llm.is_finished()
    finally:
        llm.exit()


# -- n-gram lookup ------------------------------------------------------------------------------

def test_ngram_proposes_after_the_latest_longest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # suffix [2, 3] (max 2) last occurred at 5..6 -> 7, 8, 5
    assert ngram_propose(tokens, 1, 2, 3) == [7, 8, 5]
    # with max 3 the suffix [5, 2, 3] never occurred before; [2, 3] did
    assert ngram_propose(tokens, 2, 3, 2) == [7, 8]
    # min 3: no 3-gram match -> nothing
    assert ngram_propose(tokens, 3, 3, 2) == []
    # a match near the end proposes fewer tokens
    assert ngram_propose(np.array([4, 5, 6, 4, 5]), 1, 2, 5) == [6, 4, 5]
    assert ngram_propose(np.array([7]), 1, 3, 4) == []
    rng = random.Random(0)
    for _ in range(200):  # against a direct search
        seq = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        low, high, k = rng.randint(1, 3), rng.randint(3, 5), rng.randint(1, 4)
        expected = []
        for n in range(min(high, len(seq) - 1), low - 1, -1):
            starts = [s for s in range(len(seq) - n) if seq[s:s + n] == seq[-n:]]
            if starts:
                expected = seq[starts[-1] + n:starts[-1] + n + k]
                break
        assert ngram_propose(np.array(seq), low, high, k) == expected, (seq, low, high, k)


# -- the rejection sampler ----------------------------------------------------------------------

def _sampling(temperatures, **stages) -> SimpleNamespace:
    return SimpleNamespace(batch=SamplingBatch(torch.tensor(temperatures), **stages))


def _freq(values: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(values, minlength=vocab).double() / max(1, values.numel())


def _assert_distribution(samples: torch.Tensor, expected: torch.Tensor):
    """Each token's frequency within 5 standard deviations of its probability (and 1e-3)."""
    n, got = samples.numel(), _freq(samples, expected.numel())
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((got - expected).abs() <= 5 * sigma + 1e-3).all(), (got, expected)


@pytest.mark.parametrize("case", ["t1", "t05_topk3", "draft_outside_topk"])
def test_rejection_sampling_keeps_the_target_distribution(case):
    """20,000 sequences, each with proposals [d1, d2] and three logits rows: the first kept token
    is distributed as the target's p1 (whatever d1 is); given that d1 was kept, the second as p2;
    the acceptance rate of d1 is p1(d1)."""
    vocab, n = 7, 20000
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, vocab, generator=g) * 1.5
    temperature, stages, d1, d2 = 1.0, {}, 2, 4
    if case != "t1":
        temperature = 0.5
        stages = dict(top_k=torch.full((n,), 3), top_p=torch.ones(n))
    if case == "draft_outside_topk":
        d1 = int(rows[0].argsort()[0])  # the least likely token: outside the top 3

    def target(logits):
        scaled = logits / temperature
        if stages:
            scaled = scaled.masked_fill(scaled < scaled.topk(3).values[-1], float("-inf"))
        return torch.softmax(scaled.double(), -1)

    logits = rows.repeat(n, 1)
    tokens = rejection_sample(logits, [[d1, d2]] * n, _sampling([temperature] * n, **stages),
                              torch.Generator().manual_seed(1)).view(n, 3)
    first, second = tokens[:, 0], tokens[:, 1]
    _assert_distribution(first, target(rows[0]))
    kept = first == d1
    assert kept.float().mean().item() == pytest.approx(float(target(rows[0])[d1]), abs=0.015)
    assert (second[~kept] == -2).all() and (tokens[~kept, 2] == -2).all()
    if kept.sum() > 1000:
        _assert_distribution(second[kept], target(rows[1]))


def test_rejection_sampling_with_the_drafts_distribution():
    """Proposals drawn from a draft distribution q (a draft model's, at temperature 1): the kept
    tokens are distributed as the target's p; d1 is kept with probability sum(min(p, q))."""
    vocab, n = 7, 20000
    g = torch.Generator().manual_seed(4)
    target, draft = torch.randn(3, vocab, generator=g), torch.randn(3, vocab, generator=g)
    p, q = torch.softmax(target.double(), -1), torch.softmax(draft.double(), -1).float()
    d = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in (0, 1)], 1)
    probs = torch.stack([q[0], q[1], torch.zeros(vocab)]).repeat(n, 1)
    tokens = rejection_sample(target.repeat(n, 1), d.tolist(), _sampling([1.0] * n),
                              torch.Generator().manual_seed(5), probs).view(n, 3)
    _assert_distribution(tokens[:, 0], p[0])
    kept = tokens[:, 1] != -2
    assert kept.float().mean().item() == pytest.approx(float(torch.minimum(p[0], q[0]).sum()),
                                                       abs=0.015)
    _assert_distribution(tokens[kept, 1], p[1])


def test_rejection_sampling_greedy_and_seeded_rows():
    """Greedy rows keep the proposals that the argmax agrees with, then the argmax; a seeded row
    draws the same whatever else is in the batch; non-finite logits end the run with -1."""
    vocab = 9
    rows = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    best = rows.argmax(-1).tolist()
    wrong = (best[1] + 1) % vocab
    tokens = rejection_sample(rows, [[best[0], wrong, best[2]]], _sampling([0.0]),
                              torch.Generator())
    assert tokens.tolist() == [best[0], best[1], -2, -2]
    seeded = []
    for others in (0, 3):
        seeds = [None] * others + [torch.Generator().manual_seed(42)]
        logits = torch.cat([rows] * (others + 1))
        out = rejection_sample(logits, [[1, 2, 3]] * (others + 1),
                               _sampling([1.0] * (others + 1), generators=seeds),
                               torch.Generator().manual_seed(others))
        seeded.append(out[-4:].tolist())
    assert seeded[0] == seeded[1]
    bad = rows.clone()
    bad[1, 0] = float("nan")
    assert rejection_sample(bad, [[best[0], best[1], best[2]]], _sampling([0.0]),
                            torch.Generator()).tolist() == [best[0], -1, -2, -2]


# -- the engine ---------------------------------------------------------------------------------

class OracleDrafter(Proposer):
    """Proposes each sequence's true continuation (from a plain run), the proposal at one position
    in every other step replaced by a wrong token: runs of every length are kept. After each verify
    step, checks that no sequence holds a block past its tokens (its newest token's may come with
the next step)."""

    def __init__(self, core, references: dict[tuple, list[int]], k: int = 4):
        super().__init__(k)
        self.core, self.references, self.calls = core, references, 0

    def propose(self, seqs, limits):
        drafts = []
        for seq, limit in zip(seqs, limits):
            self.calls += 1
            done = seq.num_completion_tokens
            ref = self.references[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            assert seq.completion_token_ids == ref[:done]  # the kept tokens are the target's
            draft = list(ref[done:done + limit])
            wrong_at = self.calls % (2 * self.num_lookahead_slots)
            if wrong_at < len(draft):
                draft[wrong_at] = (draft[wrong_at] + 1) % 256
            drafts.append(draft)
        return drafts

    def observe(self, seqs, drafts, num_accepted):
        super().observe(seqs, drafts, num_accepted)
        for seq in self.core.scheduler.running:
            assert seq.num_blocks - 1 <= len(seq.block_table) <= seq.num_blocks


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _run(path, prompts, params, drafter=None, **engine):
    """(token ids per completion, engine's counters): a fresh engine; ``drafter``: "ngram", or a
    callable (core) -> Drafter installed in place of the n-gram one."""
    config = NGRAM if drafter else None
    llm = LLM(path, **{**CPU_ENGINE, **engine}, speculative_config=config)
    try:
        if callable(drafter):
            llm.core.drafter = drafter(llm.core)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaks(llm)
        counters = dict(preemptions=llm.scheduler.num_preemptions,
                        hits=llm.scheduler.block_manager.num_cache_hits,
                        overlapped=getattr(llm.core, "overlapped", None))
        if drafter:
            d = llm.core
            counters.update(drafts=d.num_draft_tokens, accepted=d.num_accepted_tokens,
                            per_pos=list(d.accepted_per_pos))
        return outputs, counters
    finally:
        llm.exit()


def _repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        unit = [rng.randrange(256) for _ in range(rng.randint(3, 9))]
        prompts.append((unit * 6)[:rng.randint(20, 50)])
    return prompts


def test_ngram_greedy_equals_the_target(tiny, oracle):
    prompts = _repetitive_prompts(6)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, _ = _run(tiny, prompts, greedy)
    spec, counters = _run(tiny, prompts, greedy, drafter="ngram")
    assert counters["drafts"] > 20  # verify steps ran
    assert _tokens(spec) == _tokens(plain)
    assert_matches_oracle(oracle, tiny, prompts, [{"token_ids": t[0]} for t in _tokens(spec)], 24)


def _references(path, prompts, params, **engine):
    plain, _ = _run(path, prompts, params, **engine)
    return plain, {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}


def test_verify_steps_under_preemption_chunked_prefill_and_prefix_caching(tiny):
    """A 40-block cache for 10 sequences (preemption), a 40-token budget (chunked prefill), and a
    second wave of prompts that extend the first's (prefix-cache hits): proposals with a wrong
    token at every position, the same tokens as the plain run."""
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(20, 60))] for _ in range(10)]
    prompts += [p + [7, 8] for p in prompts[:3]]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = dict(num_kvcache_blocks=40, max_num_batched_tokens=40)
    plain, refs = _references(tiny, prompts, greedy, **engine)
    spec, counters = _run(tiny, prompts, greedy, lambda core: OracleDrafter(core, refs), **engine)
    assert _tokens(spec) == _tokens(plain)
    assert counters["preemptions"] > 0 and counters["hits"] > 0
    assert 0 < counters["accepted"] < counters["drafts"]
    assert all(counters["per_pos"])  # every position was accepted at some step


class SometimesDrafter(OracleDrafter):
    """The oracle's proposals, pending after one read-back in three: under async scheduling the
    engine goes from overlapped decodes to verify steps and back."""

    def pending(self, seqs):
        self.looks = getattr(self, "looks", 0) + 1
        return self.looks % 3 == 0


def _counting_overlap(core):
    core.overlapped = 0
    step = core.overlap_step

    def overlap_step():
        core.overlapped += 1
        return step()
    core.overlap_step = overlap_step


@pytest.mark.parametrize("drafter", ["sometimes", "ngram"])
def test_async_scheduling_overlaps_the_steps_without_proposals(tiny, drafter):
    """With async scheduling, decodes overlap while the drafter has nothing pending and verify steps
    run once it has (preemption, chunked prefill, prefix-cache hits): the plain run's tokens."""
    rng = random.Random(6)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(20, 60))] for _ in range(6)]
    prompts += [p + [7, 8] for p in prompts[:2]] + _repetitive_prompts(3, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = dict(num_kvcache_blocks=40, max_num_batched_tokens=40, async_scheduling=True)
    plain, refs = _references(tiny, prompts, greedy, **engine)

    def install(core):
        _counting_overlap(core)
        return SometimesDrafter(core, refs) if drafter == "sometimes" else core.drafter
    spec, counters = _run(tiny, prompts, greedy, install, **engine)
    assert _tokens(spec) == _tokens(plain)
    assert counters["preemptions"] > 0 and counters["hits"] > 0
    assert counters["overlapped"] > 10 and 0 < counters["accepted"] <= counters["drafts"]


def test_a_pending_proposal_after_the_last_step_was_launched(tiny):
    """The drafter has a proposal pending only once the last step is in flight: its read-back ends
    the sequence, and the engine stops there (it once asked the scheduler for a next step)."""
    class LateDrafter(OracleDrafter):
        def propose(self, seqs, limits):
            return [[] for _ in seqs]

        def pending(self, seqs):  # the count includes the token of the step in flight
            return any(s.num_completion_tokens == s.sampling_params.max_tokens for s in seqs)

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain, refs = _references(tiny, prompts, greedy, async_scheduling=True)

    def install(core):
        _counting_overlap(core)
        return LateDrafter(core, refs)
    spec, counters = _run(tiny, prompts, greedy, install, async_scheduling=True)
    assert _tokens(spec) == _tokens(plain) and counters["overlapped"] >= 6


def test_verify_steps_with_n_completions(tiny):
    """``n`` = 3 greedy completions of each prompt: every one is the target's."""
    prompts = _repetitive_prompts(3, seed=1)
    greedy = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
    plain, _ = _run(tiny, prompts, greedy)
    spec, counters = _run(tiny, prompts, greedy, drafter="ngram")
    assert counters["drafts"] > 0 and _tokens(spec) == _tokens(plain)
    assert all(len(set(map(tuple, t))) == 1 for t in _tokens(spec))


def test_stops_inside_an_accepted_run(tiny):
    """max_tokens, a stop token and a stop string that fall inside a run of accepted proposals end
    the sequence where the plain run ends it, with the same text, reason and logprobs."""
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(30)] for _ in range(4)]
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first, refs = _references(tiny, prompts, base)
    ref, text = refs[tuple(prompts[0])], first[0].outputs[0].text
    assert len(text) >= 8
    cases = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ref[5]], logprobs=0),
             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[text[5:7]])]
    for params in cases:
        plain, _ = _run(tiny, prompts, params)
        spec, counters = _run(tiny, prompts, params, lambda core: OracleDrafter(core, refs, 8))
        assert counters["accepted"] > 0
        for a, b in zip(plain, spec):
            x, y = a.outputs[0], b.outputs[0]
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
                   (y.token_ids, y.text, y.finish_reason, y.stop_reason)
            if params.logprobs is not None:
                assert len(y.logprobs) == len(y.token_ids)
                for ex, ey in zip(x.logprobs, y.logprobs):
                    assert ex.keys() == ey.keys()
                    for t in ex:
                        assert ey[t].logprob == pytest.approx(ex[t].logprob, abs=1e-4)
                        assert ey[t].rank == ex[t].rank


def test_seeded_sampling_is_the_same_whatever_else_is_batched(tiny):
    """A seeded request draws from its own generator: alone or beside others, the same tokens."""
    prompts = _repetitive_prompts(4, seed=2)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    alone, _ = _run(tiny, prompts[:1], seeded, drafter="ngram")
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    llm = LLM(tiny, **CPU_ENGINE, speculative_config=NGRAM)
    try:
        together = llm.generate(prompts, [seeded] + [others] * 3, use_tqdm=False)
    finally:
        llm.exit()
    assert _tokens(together)[0] == _tokens(alone)[0]


def test_metrics_name_vllms_counters(tiny):
    llm = LLM(tiny, **CPU_ENGINE, speculative_config=NGRAM, disable_log_stats=False)
    try:
        llm.generate(_repetitive_prompts(2, seed=3),
                     SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:
        llm.exit()
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert 0 < drafts <= draft_tokens <= 4 * drafts and accepted <= draft_tokens
    assert len(per_pos) == 4 and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))


def test_verify_steps_with_two_tensor_parallel_ranks(tiny):
    """Two ranks on gloo: the verify forward's input travels to the other rank as a step's does."""
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(10, 30))] for _ in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain, refs = _references(tiny, prompts, greedy)
    spec, counters = _run(tiny, prompts, greedy, lambda core: OracleDrafter(core, refs),
                          tensor_parallel_size=2)
    assert counters["accepted"] > 0 and _tokens(spec) == _tokens(plain)
    ngram, counters = _run(tiny, _repetitive_prompts(3, seed=4), greedy, drafter="ngram",
                           tensor_parallel_size=2)
    alone, _ = _run(tiny, _repetitive_prompts(3, seed=4), greedy)
    assert counters["drafts"] > 0 and _tokens(ngram) == _tokens(alone)


# -- a draft model ------------------------------------------------------------------------------

def _truncated(src: str, dst, num_layers: int = 1) -> str:
    """A copy of checkpoint ``src`` keeping its first ``num_layers`` layers: a draft that agrees
    with the target often, not always."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = {k: v for k, v in load_file(path).items()
               if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= num_layers)}
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    config.pop("layer_types", None)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.fixture(scope="module")
def draft(tiny, tmp_path_factory) -> str:
    return _truncated(tiny, tmp_path_factory.mktemp("draft") / "d")


def _draft_config(path: str, k: int = 3) -> dict:
    return {"model": path, "num_speculative_tokens": k}


def test_draft_model_refusals(tiny, tmp_path):
    from tiny_model import build_tiny_qwen3
    other_vocab = build_tiny_qwen3(str(tmp_path / "v"), vocab_size=330)
    other_heads = build_tiny_qwen3(str(tmp_path / "h"), num_key_value_heads=4)
    for path, named in ((other_vocab, "vocab_size"), (other_heads, "KV heads")):
        with pytest.raises(ValueError, match=named):
            LLM(tiny, speculative_config=_draft_config(path), **CPU_ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny, speculative_config=_draft_config(tiny), tensor_parallel_size=2, **CPU_ENGINE)


def _stressed(path, config: dict, seed: int, num: int, longest: int, max_tokens: int,
              **engine):
    """(plain outputs, speculative outputs, the speculative engine, shut down) of ``num`` random
    prompts and a second wave extending the first ones (prefix-cache hits), ``n`` = 2, under
    ``engine``'s cache and token budget; the speculative run is checked for leaked blocks."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(20, longest))] for _ in range(num)]
    prompts += [p + [9, 9] for p in prompts[:3]]
    greedy = SamplingParams(n=2, temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain, _ = _run(path, prompts, greedy, **engine)
    llm = LLM(path, **{**CPU_ENGINE, **engine}, speculative_config=config)
    try:
        spec = llm.generate(prompts, greedy, use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.block_manager.num_cache_hits
    return plain, spec, llm


def test_draft_model_greedy_equals_the_target(tiny, draft):
    """A one-layer draft of the two-layer target, under preemption (a 48-block cache), chunked
    prefill (a 40-token budget), prefix caching and ``n`` = 2: the plain run's tokens; some
    proposals kept, some not. The draft's cache is the target's blocks: the run leaks none."""
    plain, spec, llm = _stressed(tiny, _draft_config(draft), 6, 8, 60, 24,
                                 num_kvcache_blocks=48, max_num_batched_tokens=40)
    d = llm.core
    assert 0 < d.num_accepted_tokens < d.num_draft_tokens
    assert not llm.core.drafter.done  # every ended sequence forgotten
    assert _tokens(spec) == _tokens(plain)


def test_the_target_as_its_own_draft_is_always_right(tiny):
    """Greedy: the target proposing for itself has every proposal kept (one ``done`` bookkeeping
    slip, a stale K/V read, and it would not); sampled with a seed: proposals drawn from the
    draft's distribution (the target's) are nearly all kept, and the tokens are the same alone and
    beside other requests."""
    prompts = _repetitive_prompts(3, seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain, _ = _run(tiny, prompts, greedy)
    llm = LLM(tiny, **CPU_ENGINE, speculative_config=_draft_config(tiny, 4))
    try:
        spec = llm.generate(prompts, greedy, use_tqdm=False)
        d = llm.core
        assert d.num_draft_tokens > 20 and d.num_accepted_tokens == d.num_draft_tokens
        seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
        before = d.num_draft_tokens, d.num_accepted_tokens
        alone = llm.generate(prompts[:1], seeded, use_tqdm=False)
        together = llm.generate(prompts, [seeded] + [greedy] * 2, use_tqdm=False)
        proposed, accepted = d.num_draft_tokens - before[0], d.num_accepted_tokens - before[1]
        assert accepted >= 0.95 * proposed  # sampled from q = p: min(1, p / q) is about 1
    finally:
        llm.exit()
    assert _tokens(spec) == _tokens(plain)
    assert _tokens(alone)[0] == _tokens(together)[0]


def test_a_step_counts_the_tokens_it_computed(tiny):
    """The progress bar's rates: a prefill step counts its prompt tokens, a verify step minus the
    tokens it kept (the target as its own draft keeps all 3 proposals and its own token)."""
    llm = LLM(tiny, **CPU_ENGINE, speculative_config=_draft_config(tiny, 3))
    try:
        requests = llm._add_requests([list(range(1, 30))],
                                     SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert llm.core.interruptible_step() == 29
        assert llm.core.interruptible_step() == -4
        assert llm.core.progress == {"accepted": "100%"}
        llm.core.release(requests)
    finally:
        llm.exit()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_verify_steps_on_cuda_graphs(tiny, draft, oracle):
    """On the GPU, float32, CUDA graphs: verify rows replay the decode graphs (a bucket is a row
    count); n-gram and draft-model proposals give the plain run's greedy tokens and transformers'.
    The target as its own draft has every proposal kept."""
    from tests.conftest import ENGINE
    prompts = _repetitive_prompts(6, seed=8)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for config in (None, NGRAM, _draft_config(draft), _draft_config(tiny)):
        llm = LLM(tiny, **ENGINE, dtype="float32", speculative_config=config)
        try:
            assert llm.model_runner.graphs is not None
            runs.append(_tokens(llm.generate(prompts, greedy, use_tqdm=False)))
            assert_no_leaks(llm)
            if config:
                d = llm.core
                assert d.num_draft_tokens > 0
                if config["num_speculative_tokens"] == 3 and config.get("model") == tiny:
                    assert d.num_accepted_tokens == d.num_draft_tokens
        finally:
            llm.exit()
    assert runs[1] == runs[0] and runs[2] == runs[0] and runs[3] == runs[0]
    assert_matches_oracle(oracle, tiny, prompts, [{"token_ids": t[0]} for t in runs[0]], 24)


def test_greedy_verify_equals_the_rejection_sampler_at_temperature_zero():
    """The greedy path (a batch without sampled rows) keeps what the general one keeps."""
    from nanovllm.features.speculative import greedy_verify
    rng = random.Random(2)
    for trial in range(30):
        drafts = [[rng.randrange(6) for _ in range(rng.randint(0, 4))] for _ in range(5)]
        rows = sum(1 + len(d) for d in drafts)
        logits = torch.randn(rows, 6, generator=torch.Generator().manual_seed(trial))
        if trial % 3 == 0:
            logits[rng.randrange(rows), 2] = float("nan")
        expected = rejection_sample(logits, drafts, _sampling([0.0] * 5), torch.Generator())
        assert greedy_verify(logits, drafts).tolist() == expected.tolist()


def test_a_failing_sampling_input_ends_its_sequence_alone(tiny, monkeypatch):
    """When a verify step's sampling inputs cannot be built (here: those of the first prompt's
    sequence, once it decodes), the step runs as a plain decode, which ends that sequence alone;
    the others finish, no block leaks."""
    llm = LLM(tiny, **CPU_ENGINE, speculative_config=_draft_config(tiny, 3))
    try:
        runner, victim = llm.model_runner, []
        original = runner.prepare_sample

        def failing(batch):
            victim.append(victim[0] if victim else batch.seqs[0].seq_id)
            if not batch.is_prefill and any(seq.seq_id == victim[0] for seq in batch.seqs):
                raise RuntimeError("no inputs")
            return original(batch)
        monkeypatch.setattr(runner, "prepare_sample", failing)
        outs = llm.generate(_repetitive_prompts(3, seed=10), SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert_no_leaks(llm)
        assert llm.core.num_accepted_tokens > 0
    finally:
        llm.exit()
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "length", "length"]


# -- EAGLE-3 heads ------------------------------------------------------------------------------

def _eagle3_checkpoint(path, target_config, draft_vocab: int = 200, seed: int = 0,
                       own_embedding: bool = False) -> str:
    """A random EAGLE-3 head in the public checkpoints' layout (Llama-3.1-8B's): ``fc``,
    ``midlayer.*``, ``norm``, ``lm_head`` over a draft vocabulary, ``d2t``, ``t2d``."""
    import json
    import os

    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    heads, kv_heads, head_dim = 4, 2, 32
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.15  # noqa: E731
    targets = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": 1 + rand(hidden),
        "midlayer.hidden_norm.weight": 1 + rand(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(128, hidden),
        "midlayer.mlp.up_proj.weight": rand(128, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, 128),
        "norm.weight": 1 + rand(hidden), "lm_head.weight": rand(draft_vocab, hidden) * 4,
        "d2t": targets - torch.arange(draft_vocab), "t2d": t2d}
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, hidden) * 4
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": hidden, "intermediate_size": 128, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
              "rms_norm_eps": 1e-6, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
              "max_position_embeddings": 1024, "rope_theta": 10000.0, "hidden_act": "silu",
              "tie_word_embeddings": False}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.fixture(scope="module")
def eagle_target(tmp_path_factory) -> str:
    """A tiny six-layer Llama: the head fuses the states entering layers 2, 3 and 3."""
    from tiny_model import build_tiny_model
    return build_tiny_model(str(tmp_path_factory.mktemp("eagle") / "target"), "llama",
                            head_dim=32, num_hidden_layers=6)


def _eagle_config(path: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": path, "num_speculative_tokens": k}


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_proposals(target_path, head_path, tokens: list[int], k: int) -> list[int]:
    """The head's k greedy proposals after ``tokens``, computed from the checkpoint by hand:
    transformers' target states (the inputs of layers 2, 3, 3), every position attended anew."""
    import json
    import os

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    w = load_file(os.path.join(head_path, "model.safetensors"))
    with open(os.path.join(head_path, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    embed = w.get("embed_tokens.weight", target.model.embed_tokens.weight.detach())
    with torch.no_grad():
        hs = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    states = torch.cat([hs[2][0], hs[3][0], hs[3][0]], -1) @ w["fc.weight"].T
    inputs, in_states = list(tokens[1:]), list(states[:len(tokens) - 1])
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))

    def rope(x, pos):
        freqs = torch.outer(torch.tensor(pos).float(), inv)
        cos = torch.cat([freqs.cos()] * 2, -1)[:, None]
        sin = torch.cat([freqs.sin()] * 2, -1)[:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    proposals = []
    for _ in range(k):
        n = len(inputs)
        st = torch.stack(in_states)
        x = torch.cat([_rms(embed[torch.tensor(inputs)], w["midlayer.input_layernorm.weight"]),
                       _rms(st, w["midlayer.hidden_norm.weight"])], -1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, hd)
        kk = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, hd)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, hd)
        q, kk = rope(q, list(range(n))), rope(kk, list(range(n)))
        group = heads // kv_heads
        kk, v = kk.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / hd ** 0.5
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * hd)
        h = st + attn @ w["midlayer.self_attn.o_proj.weight"].T
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
        gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
        out = h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        logits = _rms(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T
        best = int(logits.argmax())
        proposals.append(best + int(w["d2t"][best]))
        inputs.append(proposals[-1])
        in_states.append(out[-1])
    return proposals


class _Recorder:
    """Wraps a drafter's ``propose``: keeps each step's proposals with the tokens before them."""

    def __init__(self, drafter):
        self.steps, original = [], drafter.propose

        def propose(seqs, limits):
            drafts = original(seqs, limits)
            self.steps.append({seq.seq_id: (list(seq.token_ids), list(d[:limit]))
                               for seq, d, limit in zip(seqs, drafts, limits)})
            return drafts
        drafter.propose = propose


@pytest.mark.parametrize("own_embedding", [False, True], ids=["target-embedding", "own"])
def test_eagle3_proposals_equal_a_hand_computed_head(eagle_target, tmp_path, own_embedding):
    """The engine's EAGLE-3 proposals at the first verify steps equal the head computed by hand
    from transformers' hidden states (which layers, the token shift, the fused state, the draft
    vocabulary's d2t, the head's K/V from earlier steps); the outputs are the target's."""
    from nanovllm.config import load_hf_config
    head = _eagle3_checkpoint(tmp_path / "head", load_hf_config(eagle_target),
                              own_embedding=own_embedding)
    prompts = [[5, 17, 99, 3, 42, 8, 77], list(range(30, 52))]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain, _ = _run(eagle_target, prompts, greedy)
    llm = LLM(eagle_target, **CPU_ENGINE, speculative_config=_eagle_config(head))
    try:
        recorder = _Recorder(llm.core.drafter)
        spec = llm.generate(prompts, greedy, use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert _tokens(spec) == _tokens(plain)
    checked = 0
    for step in recorder.steps[:3]:
        for tokens, draft in step.values():
            if draft:
                assert draft == _reference_proposals(eagle_target, head, tokens, len(draft))
                checked += 1
    assert checked >= 4


def test_eagle3_greedy_equals_the_target_under_preemption_and_chunks(eagle_target, tmp_path):
    """Preemption (a 30-block cache), chunked prefill (a 24-token budget: the head runs over each
    chunk's positions), a second wave hitting the prefix cache and ``n`` = 2: the plain run's
    tokens."""
    from nanovllm.config import load_hf_config
    head = _eagle3_checkpoint(tmp_path / "head", load_hf_config(eagle_target), seed=1)
    plain, spec, llm = _stressed(eagle_target, _eagle_config(head), 11, 6, 50, 20,
                                 num_kvcache_blocks=30, max_num_batched_tokens=24)
    assert llm.core.num_draft_tokens > 0
    assert not llm.core.drafter.first  # every ended sequence forgotten
    assert _tokens(spec) == _tokens(plain)


def test_eagle3_refusals(eagle_target, tiny, tmp_path):
    from nanovllm.config import load_hf_config
    head = _eagle3_checkpoint(tmp_path / "head", load_hf_config(eagle_target))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        LLM(eagle_target, speculative_config=_eagle_config(eagle_target), **CPU_ENGINE)
    with pytest.raises(ValueError, match="three target layers"):  # tiny has 2 layers
        LLM(tiny, speculative_config=_eagle_config(head), **CPU_ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(eagle_target, speculative_config=_eagle_config(head), tensor_parallel_size=2,
            **CPU_ENGINE)


def test_eagle3_sampled_with_a_seed_is_the_same_whatever_else_is_batched(eagle_target, tmp_path):
    from nanovllm.config import load_hf_config
    head = _eagle3_checkpoint(tmp_path / "head", load_hf_config(eagle_target), seed=2)
    prompts = _repetitive_prompts(3, seed=12)
    seeded = SamplingParams(temperature=1.0, top_k=40, seed=5, max_tokens=16, ignore_eos=True)
    others = SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True)
    llm = LLM(eagle_target, **CPU_ENGINE, speculative_config=_eagle_config(head))
    try:
        alone = llm.generate(prompts[:1], seeded, use_tqdm=False)
        together = llm.generate(prompts, [seeded] + [others] * 2, use_tqdm=False)
        assert llm.core.num_draft_tokens > 0
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert _tokens(together)[0] == _tokens(alone)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eagle3_on_cuda_graphs(eagle_target, tmp_path):
    """On the GPU, float32, CUDA graphs: the hooks' copies of the target's states are captured in
    the decode graphs (a verify step replays them); the outputs are the plain run's and the first
    proposals the hand-computed head's."""
    from nanovllm.config import load_hf_config
    from tests.conftest import ENGINE
    head = _eagle3_checkpoint(tmp_path / "head", load_hf_config(eagle_target))
    prompts = [[5, 17, 99, 3, 42, 8, 77], list(range(30, 52))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for config in (None, _eagle_config(head)):
        llm = LLM(eagle_target, **ENGINE, dtype="float32", speculative_config=config)
        try:
            assert llm.model_runner.graphs is not None
            recorder = _Recorder(llm.core.drafter) if config else None
            outputs.append(_tokens(llm.generate(prompts, greedy, use_tqdm=False)))
        finally:
            llm.exit()
    assert outputs[1] == outputs[0]
    for step in recorder.steps[1:3]:  # after a verify step (graph replays)
        for tokens, draft in step.values():
            if draft:
                assert draft == _reference_proposals(eagle_target, head, tokens, len(draft))


def test_penalties_and_min_tokens_row_by_row(tiny):
    """Penalties (a row's generated tokens include the proposals before it) and min_tokens (a stop
    token banned at the rows still under it): the plain run's tokens, with proposals right at
    every length, and with n-gram lookup."""
    rng = random.Random(13)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(10, 30))] for _ in range(4)]
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first, _ = _references(tiny, prompts, base)
    stop = first[0].outputs[0].token_ids[1]  # the first prompt's second token: banned until 5
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.4,
                            presence_penalty=0.4, frequency_penalty=0.3, min_tokens=5,
                            stop_token_ids=[stop], ignore_eos=True)
    plain, refs = _references(tiny, prompts, params)
    assert plain[0].outputs[0].token_ids != first[0].outputs[0].token_ids  # the params matter
    spec, counters = _run(tiny, prompts, params, lambda core: OracleDrafter(core, refs))
    assert counters["accepted"] > 0 and _tokens(spec) == _tokens(plain)
    ngram, _ = _run(tiny, prompts, params, drafter="ngram")
    assert _tokens(ngram) == _tokens(plain)


def test_min_tokens_lifts_at_the_right_row(tiny):
    """A stop token that the plain run emits as its third token, with min_tokens 2: banned at the
    second token's row only, so a verify step whose second row is the third token stops there."""
    rng = random.Random(14)
    prompts = [[rng.randrange(256) for _ in range(20)] for _ in range(3)]
    free, refs = _references(tiny, prompts, SamplingParams(temperature=0, max_tokens=12,
                                                           ignore_eos=True))
    stop = free[0].outputs[0].token_ids[2]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=2, stop_token_ids=[stop],
                            ignore_eos=True)
    plain, _ = _run(tiny, prompts, params)
    assert plain[0].outputs[0].finish_reason == "stop"
    spec, _ = _run(tiny, prompts, params, lambda core: OracleDrafter(core, refs))
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in spec] == \
           [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in plain]


def test_ngram_keeps_each_sequences_tokens_between_steps():
    """The array a sequence's lookup reads grows with it (only new tokens copied) and is dropped
    when the sequence ends."""
    from nanovllm.engine.sequence import Sequence
    drafter = NgramDrafter(parse_speculative_config(NGRAM))
    seq = Sequence([1, 2, 3, 1, 2])
    assert drafter.propose([seq], [4]) == [[3, 1, 2]]
    for t in [3, 9, 9, 1, 2] * 20:
        seq.token_ids.append(t)
        assert drafter.tokens(seq).tolist() == seq.token_ids
    assert drafter.propose([seq], [2]) == [[3, 9]]
    drafter.forget(seq)
    assert not drafter.arrays
