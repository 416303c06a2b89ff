"""Cascade decode attention (a shared prefix read once for the rows that share it): the groups found
from block tables, the PyTorch cascade and the Triton kernels against ``reference.decode_attention``
(float64) on fresh random caches whose rows share leading blocks; then the rule and the engine with
and without the cascade (the same tokens). On CPU the kernels run under TRITON_INTERPRET=1
(conftest)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nanovllm.kernels import cascade_reference, reference
from nanovllm.kernels.cascade_reference import (
    as_shared_prefixes,
    cascade_decode_attention,
    shared_prefix_groups,
)

triton_attention = pytest.importorskip("nanovllm.kernels.triton_attention")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
FP8 = torch.float8_e4m3fn


def test_groups_of_a_hand_made_batch():
    b = 4  # block size
    tables = [[7, 8, 9], [7, 8, 3], [7, 8, 5, 6],  # three rows share blocks 7, 8
              [1, 2], [1, 4],                       # two share block 1
              [9, 9],                               # alone
              [5, 6, 0], [5, 6, 2]]                 # share 5, 6
    lens = [12, 10, 13, 8, 5, 8, 9, 12]
    assert shared_prefix_groups(tables, lens, b) == [(0, 3, 2), (3, 2, 1), (6, 2, 2)]
    # a row's last token stays outside the shared blocks: a context of 8 ends in the second block,
    # so only the first is shared; of 9, two are
    assert shared_prefix_groups([[1, 2, 3], [1, 2, 3]], [8, 12], b) == [(0, 2, 1)]
    assert shared_prefix_groups([[1, 2, 3], [1, 2, 3]], [9, 12], b) == [(0, 2, 2)]
    assert shared_prefix_groups([[1, 2], [1, 2]], [4, 8], b) == []  # block 1 holds row 0's last
    assert shared_prefix_groups(tables, lens, b, min_rows=3) == [(0, 3, 2)]
    assert shared_prefix_groups(tables, lens, b, min_blocks=2) == [(0, 3, 2), (6, 2, 2)]


def _groups_one_by_one(tables, lens, block, min_blocks=1):
    """The definition, row by row: a run grows while the next row shares at least min_blocks
    leading blocks with its first row, within every row's full blocks before its last token."""
    groups, row = [], 0
    while row < len(tables):
        common, end = (lens[row] - 1) // block, row + 1
        while end < len(tables):
            shared, cap = 0, min(common, (lens[end] - 1) // block)
            while shared < cap and tables[end][shared] == tables[row][shared]:
                shared += 1
            if shared < min_blocks:
                break
            common, end = shared, end + 1
        if end - row >= 2 and common >= min_blocks:
            groups.append((row, end - row, common))
        row = end
    return groups


def test_groups_hold_their_invariants_on_random_tables():
    rng = random.Random(0)
    for _ in range(300):
        block = rng.choice([1, 2, 4])
        tables, lens = [], []
        for _ in range(rng.randint(1, 12)):
            if tables and rng.random() < 0.6:  # a sibling of the previous row
                keep = rng.randint(0, len(tables[-1]))
                t = tables[-1][:keep] + [rng.randint(100, 999) for _ in range(rng.randint(0, 3))]
            else:
                t = [rng.randint(0, 50) for _ in range(rng.randint(1, 5))]
            if not t:
                t = [rng.randint(100, 999)]
            tables.append(t)
            lens.append(rng.randint((len(t) - 1) * block + 1, len(t) * block))
        groups = shared_prefix_groups(tables, lens, block)
        assert groups == _groups_one_by_one(tables, lens, block)
        padded = np.full((len(tables), max(map(len, tables))), -1, dtype=np.int32)
        for r, t in enumerate(tables):
            padded[r, :len(t)] = t
        assert shared_prefix_groups(padded, lens, block) == groups
        assert (shared_prefix_groups(tables, lens, block, min_blocks=2)
                == _groups_one_by_one(tables, lens, block, min_blocks=2))
        covered = []
        for first, rows, shared in groups:
            assert rows >= 2 and shared >= 1
            covered += range(first, first + rows)
            for r in range(first, first + rows):
                assert tables[r][:shared] == tables[first][:shared]
                assert shared * block <= lens[r] - 1  # the last token outside
        assert covered == sorted(set(covered))  # disjoint, in order
        # maximal: two adjacent rows outside every group never share a usable block
        in_group = set(covered)
        for r in range(len(tables) - 1):
            if r not in in_group and r + 1 not in in_group:
                cap = min((lens[r] - 1) // block, (lens[r + 1] - 1) // block)
                assert cap == 0 or tables[r][0] != tables[r + 1][0]


def shared_cache(groups_spec, num_kv_heads, head_dim, block, dtype, seed):
    """A cache and tables where each spec (rows, shared blocks, [own tokens per row]) is a run of
    rows holding the same first blocks, then blocks of their own; rows with shared 0 stand alone."""
    g = torch.Generator().manual_seed(seed)
    tables, lens, next_block = [], [], 0
    for rows, shared, own in groups_spec:
        prefix = list(range(next_block, next_block + shared))
        next_block += shared
        for r in range(rows):
            n_own = (own[r] + block - 1) // block
            tables.append(prefix + list(range(next_block, next_block + n_own)))
            next_block += n_own
            lens.append(shared * block + own[r])
    perm = torch.randperm(next_block + 2, generator=g).tolist()  # scatter the blocks
    tables = [[perm[b] for b in t] for t in tables]
    k_cache = torch.randn(next_block + 2, block, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(next_block + 2, block, num_kv_heads, head_dim, generator=g).to(dtype)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), bt.to(DEVICE), tables, lens


CASES = {  # (heads, kv heads, head dim, block, [(rows, shared blocks, own tokens per row)])
    "n8-one-group": (8, 2, 64, 16, [(8, 3, [1, 5, 16, 17, 2, 9, 30, 4])]),
    "two-groups-and-loners": (4, 4, 64, 16, [(1, 0, [40]), (3, 2, [7, 1, 20]), (1, 0, [3]),
                                             (2, 1, [16, 33])]),
    "gqa8-big-group": (16, 2, 128, 32, [(20, 2, [1 + 3 * i for i in range(20)])]),
    # groups of several tiles each (the kernel maps its tiles to groups by their tile counts)
    "three-groups-of-tiles": (8, 2, 64, 16, [(6, 2, [3, 9, 1, 16, 20, 5]), (1, 0, [7]),
                                             (9, 1, [2 + 2 * i for i in range(9)]),
                                             (5, 3, [1, 2, 3, 4, 40])]),
}


def _inputs(name, dtype, seed):
    heads, kv_heads, d, block, spec = CASES[name]
    k_cache, v_cache, bt, tables, lens = shared_cache(spec, kv_heads, d, block, dtype, seed)
    q = torch.randn(len(lens), heads, d, device=DEVICE).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    groups = shared_prefix_groups(tables, lens, block)
    return q, k_cache, v_cache, bt, ctx, as_shared_prefixes(groups, len(lens), block, DEVICE), d


@pytest.mark.parametrize("name", list(CASES))
def test_groups_found_in_the_cases(name):
    *_, prefixes, _ = _inputs(name, torch.float32, 0)
    spec = CASES[name][4]
    assert sum(rows for rows, shared, _ in spec if shared) == int(prefixes.num_rows.sum())
    assert prefixes.first_row.numel() == sum(1 for rows, shared, _ in spec if shared)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_cascade_equals_plain_decode(name):
    q, k_cache, v_cache, bt, ctx, prefixes, d = _inputs(name, torch.float64, 1)
    plain = reference.decode_attention(q, k_cache, v_cache, ctx, bt, d ** -0.5)
    cascade = cascade_decode_attention(q, k_cache, v_cache, ctx, bt, d ** -0.5,
                                       prefixes=prefixes)
    torch.testing.assert_close(cascade, plain, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits, parts", [(1, None), (3, None), (1, 1), (2, 5)])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_cascade_matches_reference(name, splits, parts, dtype):
    """``parts``: the shared keys' ranges (None: the default; 5 leaves some ranges empty)."""
    q, k_cache, v_cache, bt, ctx, prefixes, d = _inputs(name, dtype, 2)
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), ctx, bt,
                                     d ** -0.5)
    out = torch.full_like(q, float("nan"))
    triton_attention.decode_attention(q, k_cache, v_cache, ctx, bt, d ** -0.5, num_splits=splits,
                                      out=out, prefixes=prefixes, prefix_parts=parts)
    assert not out.isnan().any()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < TOL[dtype], err


def test_a_fixed_capacity_of_groups_gives_the_same_result():
    """Groups padded to a capacity (empty ones) and a grid sized by the batch, as a CUDA graph
    would replay them: the same output, and the reference cascade skips the empty groups."""
    q, k_cache, v_cache, bt, ctx, prefixes, d = _inputs("two-groups-and-loners", torch.float32, 6)
    spec = CASES["two-groups-and-loners"]
    tables = [[b for b in row if b >= 0] for row in bt.tolist()]
    groups = shared_prefix_groups(tables, ctx.tolist(), spec[3])
    padded = as_shared_prefixes(groups, len(tables), spec[3], DEVICE, capacity=len(tables) // 2)
    assert padded.first_row.numel() == len(tables) // 2 and padded.max_rows == len(tables)
    want = triton_attention.decode_attention(q, k_cache, v_cache, ctx, bt, d ** -0.5,
                                             prefixes=prefixes)
    got = triton_attention.decode_attention(q, k_cache, v_cache, ctx, bt, d ** -0.5,
                                            prefixes=padded)
    torch.testing.assert_close(got, want)
    ref = cascade_decode_attention(q.double(), k_cache.double(), v_cache.double(), ctx, bt,
                                   d ** -0.5, prefixes=padded)
    torch.testing.assert_close(ref, reference.decode_attention(
        q.double(), k_cache.double(), v_cache.double(), ctx, bt, d ** -0.5))
    with pytest.raises(ValueError, match="capacity=1"):
        as_shared_prefixes(groups, len(tables), spec[3], DEVICE, capacity=1)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_prefix_programs_deal_out_the_groups_tiles(programs, monkeypatch):
    """However many programs the shared prefixes get (one takes every (tile, KV head, part); 64
    leave most without one), the groups padded as a graph holds them give the same output."""
    q, k_cache, v_cache, bt, ctx, prefixes, d = _inputs("two-groups-and-loners", torch.float32, 6)
    want = triton_attention.decode_attention(q, k_cache, v_cache, ctx, bt, d ** -0.5,
                                             prefixes=prefixes)
    spec = CASES["two-groups-and-loners"]
    tables = [[b for b in row if b >= 0] for row in bt.tolist()]
    padded = as_shared_prefixes(shared_prefix_groups(tables, ctx.tolist(), spec[3]), len(tables),
                                spec[3], DEVICE, capacity=len(tables) // 2)
    monkeypatch.setattr(triton_attention, "max_prefix_programs", lambda device: programs)
    got = triton_attention.decode_attention(q, k_cache, v_cache, ctx, bt, d ** -0.5,
                                            prefixes=padded, prefix_parts=2)
    torch.testing.assert_close(got, want)


def test_triton_cascade_reads_the_shared_blocks_once_from_the_group():
    """The prefix part reads the group's first row's table: corrupting another row's copy of the
    shared block ids leaves the result unchanged; corrupting the first row's changes it."""
    q, k_cache, v_cache, bt, ctx, prefixes, d = _inputs("n8-one-group", torch.float32, 3)
    want = triton_attention.decode_attention(q, k_cache, v_cache, ctx, bt, d ** -0.5,
                                             prefixes=prefixes)
    spare = min(set(range(k_cache.size(0))) - set(bt.flatten().tolist()))  # no table holds it
    other = bt.clone()
    other[1:, 0] = spare
    same = triton_attention.decode_attention(q, k_cache, v_cache, ctx, other, d ** -0.5,
                                             prefixes=prefixes)
    torch.testing.assert_close(same, want)
    first = bt.clone()
    first[0, 0] = spare
    moved = triton_attention.decode_attention(q, k_cache, v_cache, ctx, first, d ** -0.5,
                                              prefixes=prefixes)
    assert (moved[1:] - want[1:]).abs().max() > 1e-3


def test_triton_cascade_over_an_fp8_cache():
    q, k_cache, v_cache, bt, ctx, prefixes, d = _inputs("two-groups-and-loners", torch.float32, 4)
    k8, v8 = (k_cache * 30).to(FP8), (v_cache * 0.1).to(FP8)
    ref = reference.decode_attention(q.double(), k8, v8, ctx, bt, 0.05, 0.5, 4.0)
    out = triton_attention.decode_attention(q, k8, v8, ctx, bt, 0.05, 0.5, 4.0, prefixes=prefixes)
    assert float((out.double() - ref).norm() / ref.norm()) < TOL[torch.float32]


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_cascade_refuses_a_sliding_window(kernel):
    q, k_cache, v_cache, bt, ctx, prefixes, d = _inputs("n8-one-group", torch.float32, 5)
    decode = (triton_attention.decode_attention if kernel == "triton"
              else cascade_decode_attention)
    with pytest.raises(ValueError, match="window=32"):
        decode(q, k_cache, v_cache, ctx, bt, 0.1, window=32, prefixes=prefixes)


# --- the engine: decode steps group their rows by the rule (cascade_groups) ---------------------

def test_rule_keeps_groups_that_pay_and_those_that_save_most(monkeypatch):
    monkeypatch.setattr(cascade_reference, "MAX_GROUPS", 2)
    b = 4
    tables = np.array([[1, 2, 9], [1, 2, 8], [1, 2, 7], [1, 2, 6],  # 4 rows, 8 tokens: saves 24
                       [3, 5, 0], [3, 5, 4], [3, 5, 10],            # 3 rows: below MIN_ROWS
                       [11, 12, 13], [11, 12, 14], [11, 12, 15], [11, 12, 16], [11, 12, 17]])
    lens = np.full(len(tables), 3 * b)
    monkeypatch.setattr(cascade_reference, "MIN_ROWS", 4)
    monkeypatch.setattr(cascade_reference, "MIN_SHARED_TOKENS", 8)
    monkeypatch.setattr(cascade_reference, "MIN_SAVED_TOKENS", 0)
    groups, seq_shared, rows = cascade_reference.cascade_groups(tables, lens, b)
    assert groups.tolist() == [[0, 7], [4, 5], [8, 8]] and rows == 5
    assert seq_shared.tolist() == [8] * 4 + [0] * 3 + [8] * 5
    monkeypatch.setattr(cascade_reference, "MAX_GROUPS", 1)  # the five rows save more
    groups, seq_shared, _ = cascade_reference.cascade_groups(tables, lens, b)
    assert groups.tolist() == [[7], [5], [8]] and seq_shared.tolist() == [0] * 7 + [8] * 5
    monkeypatch.setattr(cascade_reference, "MIN_SAVED_TOKENS", 5 * 8)  # saves 4 * 8
    assert cascade_reference.cascade_groups(tables, lens, b) is None
    monkeypatch.setattr(cascade_reference, "MIN_SAVED_TOKENS", 4 * 8)
    assert cascade_reference.cascade_groups(tables, lens, b) is not None
    monkeypatch.setattr(cascade_reference, "MIN_SHARED_TOKENS", 9)  # three blocks: none has them
    assert cascade_reference.cascade_groups(tables, lens, b) is None


@pytest.fixture
def counted_cascade(monkeypatch):
    """The rule lowered to tiny models' sizes (2 rows, one 16-token block); counts the torch
    backend's cascade calls."""
    from nanovllm.layers import attention
    monkeypatch.setattr(cascade_reference, "MIN_ROWS", 2)
    monkeypatch.setattr(cascade_reference, "MIN_SHARED_TOKENS", 16)
    monkeypatch.setattr(cascade_reference, "MIN_SAVED_TOKENS", 16)
    calls = []

    def cascade(*args, **kw):
        calls.append(kw["prefixes"].first_row.numel())
        return cascade_decode_attention(*args, **kw)
    monkeypatch.setattr(attention, "cascade_decode_attention", cascade)
    return calls


def _shared_prefix_prompts(n: int, prefix_len: int = 50, seed: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(prefix_len)]
    return prefix, [prefix + [rng.randrange(256) for _ in range(rng.randint(3, 20))]
                    for _ in range(n)]


def _generate_both_ways(path, waves, params, **engine):
    """Each wave's outputs (token ids), run with cascade decode and without, on fresh engines."""
    from nanovllm import LLM
    from tests.conftest import CPU_ENGINE, assert_no_leaks
    runs = []
    for disable in (False, True):
        llm = LLM(path, **{**CPU_ENGINE, **engine}, disable_cascade_attn=disable)
        try:
            runs.append([[o["token_ids"] for o in llm.generate(w, params, use_tqdm=False)]
                         for w in waves])
            assert_no_leaks(llm)
            runs[-1].append(llm.scheduler.num_preemptions)
        finally:
            llm.exit()
    return runs


def test_engine_cascade_equals_the_plain_path(tiny, oracle, counted_cascade):
    """A cached shared prefix (a first request leaves it in the prefix cache), then 6 prompts
    that hit it: the same greedy tokens with the cascade as without, and as transformers'."""
    from nanovllm import SamplingParams
    from tests.conftest import assert_matches_oracle
    prefix, prompts = _shared_prefix_prompts(6)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cascade, plain = _generate_both_ways(tiny, [[prefix + [1]], prompts], greedy)
    assert counted_cascade and all(g == 1 for g in counted_cascade)  # one group, every layer
    assert cascade == plain
    assert_matches_oracle(oracle, tiny, prompts, [{"token_ids": t} for t in cascade[1]], 12)


def test_engine_cascade_with_n_siblings_and_seeds(tiny, counted_cascade):
    """``n`` completions of two prompts (two groups once the first prefill is cached), greedy and
    sampled with a seed: the same tokens with and without the cascade."""
    from nanovllm import SamplingParams
    prefix, prompts = _shared_prefix_prompts(2, prefix_len=40, seed=1)
    waves = [[prefix + [2]], prompts]
    for params in (SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True),
                   SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)):
        cascade, plain = _generate_both_ways(tiny, waves, params)
        assert cascade == plain
    assert max(counted_cascade) == 1 and counted_cascade  # 8 rows under one shared prefix


def test_engine_cascade_under_preemption_and_chunked_prefill(tiny, oracle, counted_cascade):
    """A cache of 20 blocks for 12 sequences of ~80 tokens (preemption) and a 40-token budget
    (chunked prefill): the same tokens with and without the cascade."""
    from nanovllm import SamplingParams
    from tests.conftest import assert_matches_oracle
    prefix, prompts = _shared_prefix_prompts(12, prefix_len=48, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cascade, plain = _generate_both_ways(tiny, [[prefix + [3]], prompts], greedy,
                                         num_kvcache_blocks=20, max_num_batched_tokens=40)
    assert cascade[-1] > 0 and plain[-1] > 0, "the cache should have forced preemption"
    assert counted_cascade and cascade == plain
    assert_matches_oracle(oracle, tiny, prompts, [{"token_ids": t} for t in cascade[1]], 16)


def test_engine_beam_search_with_and_without_the_cascade(tiny, counted_cascade):
    from nanovllm import LLM
    from nanovllm.features.beam_search import BeamSearchParams
    from tests.conftest import CPU_ENGINE
    _, prompts = _shared_prefix_prompts(2, prefix_len=40, seed=3)
    results = []
    for disable in (False, True):
        llm = LLM(tiny, **CPU_ENGINE, disable_cascade_attn=disable)
        try:
            outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5))
            results.append([[(s.tokens, round(s.cum_logprob, 5)) for s in o.sequences]
                            for o in outs])
        finally:
            llm.exit()
    assert results[0] == results[1]


def test_engine_cascade_skips_sliding_window_layers(family_checkpoints, oracle, counted_cascade):
    """Qwen2 with a window on its second layer: the first layer takes the cascade, the windowed
    one reads its own keys; the tokens match transformers'."""
    from nanovllm import SamplingParams
    from tests.conftest import assert_matches_oracle
    path = family_checkpoints["qwen2_window_mixed"]
    prefix, prompts = _shared_prefix_prompts(5, prefix_len=32, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cascade, plain = _generate_both_ways(path, [[prefix + [4]], prompts], greedy)
    assert cascade == plain and len(counted_cascade) == 7  # 7 decode steps x one unwindowed layer
    assert_matches_oracle(oracle, path, prompts, [{"token_ids": t} for t in cascade[1]], 8)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_engine_cascade_on_cuda_graphs(tiny, oracle):
    """The Triton backend under CUDA graphs (a bucket's cascade graph captured on first use),
    float32: the same greedy tokens with and without the cascade, and transformers'."""
    from nanovllm import LLM, SamplingParams
    from tests.conftest import ENGINE, assert_matches_oracle
    prefix, prompts = _shared_prefix_prompts(6)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    names = ("MIN_ROWS", "MIN_SHARED_TOKENS", "MIN_SAVED_TOKENS")
    old = [getattr(cascade_reference, name) for name in names]
    for name, value in zip(names, (2, 16, 16)):
        setattr(cascade_reference, name, value)
    try:
        for disable in (False, True):
            llm = LLM(tiny, **ENGINE, dtype="float32", disable_cascade_attn=disable)
            try:
                llm.generate([prefix + [1]], greedy, use_tqdm=False)
                runs[disable] = [o["token_ids"] for o in llm.generate(prompts, greedy,
                                                                       use_tqdm=False)]
                graphs = llm.model_runner.graphs.graphs
                assert any(cascade for _, cascade in graphs) != disable
            finally:
                llm.exit()
    finally:
        for name, value in zip(names, old):
            setattr(cascade_reference, name, value)
    assert runs[False] == runs[True]
    assert_matches_oracle(oracle, tiny, prompts, [{"token_ids": t} for t in runs[False]], 12)


@pytest.mark.parametrize("engine", [dict(kv_cache_dtype="fp8"), dict(tensor_parallel_size=2)],
                         ids=["fp8-cache", "tp2"])
def test_engine_cascade_with_an_fp8_cache_and_tensor_parallel(tiny, counted_cascade, engine):
    """An fp8 cache (the cascade dequantizes the shared blocks as the plain path does) and two
    tensor-parallel ranks (the groups travel in the step's input to the other rank): the same
    tokens with and without the cascade."""
    from nanovllm import SamplingParams
    prefix, prompts = _shared_prefix_prompts(5, prefix_len=48, seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cascade, plain = _generate_both_ways(tiny, [[prefix + [5]], prompts], greedy, **engine)
    assert counted_cascade and cascade == plain


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_engine_cascade_on_cuda_with_siblings_preemption_and_chunks(tiny, monkeypatch):
    """The Triton backend under CUDA graphs, float32, async scheduling: ``n`` completions (greedy
    and seeded), then a cache small enough to preempt with a 40-token budget; the same tokens with
    and without the cascade."""
    from nanovllm import SamplingParams
    for name, value in (("MIN_ROWS", 2), ("MIN_SHARED_TOKENS", 16), ("MIN_SAVED_TOKENS", 16)):
        monkeypatch.setattr(cascade_reference, name, value)
    cuda = dict(device="cuda", dtype="float32")
    prefix, prompts = _shared_prefix_prompts(2, prefix_len=40, seed=1)
    for params in (SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True),
                   SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)):
        cascade, plain = _generate_both_ways(tiny, [[prefix + [2]], prompts], params, **cuda)
        assert cascade == plain
    prefix, prompts = _shared_prefix_prompts(12, prefix_len=48, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cascade, plain = _generate_both_ways(tiny, [[prefix + [3]], prompts], greedy,
                                         num_kvcache_blocks=20, max_num_batched_tokens=40, **cuda)
    assert cascade[-1] > 0 and cascade == plain
