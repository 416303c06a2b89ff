"""Unit tests of the pieces: slot mapping (a worked example), block manager, sampler."""
from __future__ import annotations

import torch

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels import reference
from nanovllm.layers.sampler import Sampler, SamplingBatch


def _runner(block_size: int) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # only the batch-building methods, no model
    runner.block_size, runner.is_cuda, runner.device = block_size, False, torch.device("cpu")
    return runner


def test_slot_mapping_worked_example():
    # block_table [4, 5, 9, 3, 11], block_size 8, tokens [1, 38) scheduled: slot = table[p // 8] * 8 + p % 8
    seq = Sequence(list(range(38)), block_size=8)
    seq.block_table = [4, 5, 9, 3, 11]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 1, 37
    input_ids, positions, ctx = _runner(8).prepare_prefill([seq])
    expected = [*range(33, 40), *range(40, 48), *range(72, 80), *range(24, 32), *range(88, 94)]
    assert ctx["slot_mapping"].tolist() == expected
    assert input_ids.tolist() == list(range(1, 38)) and positions.tolist() == list(range(1, 38))
    assert ctx["cu_seqlens_q"].tolist() == [0, 37] and ctx["cu_seqlens_k"].tolist() == [0, 38]
    assert ctx["block_tables"].tolist() == [[4, 5, 9, 3, 11]]  # keys partly cached: block tables needed
    # every slot is block_table[p // bs] * bs + p % bs
    assert expected == [seq.block_table[p // 8] * 8 + p % 8 for p in range(1, 38)]


def test_prepare_decode():
    a, b = Sequence(list(range(10)), block_size=4), Sequence(list(range(5)), block_size=4)
    a.block_table, b.block_table = [7, 2, 5], [1, 0]
    ids, pos, ctx = _runner(4).prepare_decode([a, b])
    assert ids.tolist() == [9, 4] and pos.tolist() == [9, 4]
    assert ctx["slot_mapping"].tolist() == [5 * 4 + 1, 0 * 4 + 0]
    assert ctx["context_lens"].tolist() == [10, 5]
    assert ctx["block_tables"].tolist() == [[7, 2, 5], [1, 0, -1]]


def test_block_manager_prefix_cache_and_refcounts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(list(range(10)), block_size=4)
    bm.allocate(a)
    assert a.num_cached_tokens == 0 and len(a.block_table) == 3
    a.num_scheduled_tokens = 10
    a.num_cached_tokens = 10
    bm.hash_blocks(a)  # blocks 0 and 1 are full and computed
    b = Sequence(list(range(8)) + [99, 98, 97], block_size=4)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    # a prompt entirely cached still computes its last block
    c = Sequence(list(range(8)), block_size=4)
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1] and c.num_cached_tokens == 4
    for seq in (a, b, c):
        bm.deallocate(seq)
    assert len(bm.free_block_ids) == 8 and all(blk.ref_count == 0 for blk in bm.blocks)
    # freed blocks keep their contents for later hits
    d = Sequence(list(range(9)), block_size=4)
    bm.allocate(d)
    assert d.num_cached_tokens == 8


def test_store_kvcache_skips_padding():
    k_cache = torch.zeros(3, 2, 1, 4)
    v_cache = torch.zeros(3, 2, 1, 4)
    k = torch.randn(3, 1, 4)
    reference.store_kvcache(k, -k, k_cache, v_cache, torch.tensor([5, -1, 0], dtype=torch.int32))
    flat = k_cache.view(6, 1, 4)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[0], k[2])
    assert flat[1:5].abs().sum() == 0 and torch.equal(v_cache.view(6, 1, 4)[5], -k[0])


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
        assert ((freq - p).abs() <= 5 * stderr + 1e-12).all() and (freq - p).abs().max() < 0.01, (freq, p)


def test_context_is_reset_even_when_the_forward_raises():
    from nanovllm.utils.context import get_context, set_context
    empty = get_context()
    try:
        with set_context(True, max_seqlen_q=3):
            assert get_context().is_prefill and get_context().max_seqlen_q == 3
            raise RuntimeError("forward failed")
    except RuntimeError:
        pass
    assert get_context() is empty
