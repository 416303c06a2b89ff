"""Unit tests of the pieces: slot mapping (a worked example), block manager, sampler."""
from __future__ import annotations

import torch

from nanovllm.engine.batch import build_decode, build_prefill
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels import reference
from nanovllm.layers.sampler import Sampler, SamplingBatch


def test_slot_mapping_worked_example():
    # block_table [4, 5, 9, 3, 11], block_size 8, tokens [1, 38) scheduled: slot = table[p // 8] * 8 + p % 8
    seq = Sequence(list(range(38)), block_size=8)
    seq.block_table = [4, 5, 9, 3, 11]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 1, 37
    step = build_prefill([seq], 8)  # a pure function of the sequences: no runner, no model
    expected = [*range(33, 40), *range(40, 48), *range(72, 80), *range(24, 32), *range(88, 94)]
    assert step.slot_mapping.tolist() == expected
    assert step.input_ids.tolist() == list(range(1, 38)) and step.positions.tolist() == list(range(1, 38))
    assert step.cu_seqlens_q.tolist() == [0, 37] and step.cu_seqlens_k.tolist() == [0, 38]
    assert step.block_tables.tolist() == [[4, 5, 9, 3, 11]]  # keys partly cached: block tables needed
    assert step.max_seqlen_q == 37 and step.max_seqlen_k == 38 and step.logits_indices.tolist() == [36]
    # every slot is block_table[p // bs] * bs + p % bs
    assert expected == [seq.block_table[p // 8] * 8 + p % 8 for p in range(1, 38)]


def test_prefill_of_several_sequences_and_the_warmup():
    a, b = Sequence(list(range(5)), block_size=4), Sequence(list(range(10, 13)), block_size=4)
    a.block_table, b.block_table = [3, 1], [2]
    a.num_scheduled_tokens, b.num_scheduled_tokens = 5, 3
    b.computes_prompt_logprobs = True
    step = build_prefill([a, b], 4)
    assert step.input_ids.tolist() == [0, 1, 2, 3, 4, 10, 11, 12]
    assert step.slot_mapping.tolist() == [12, 13, 14, 15, 4, 8, 9, 10]
    assert step.cu_seqlens_q.tolist() == [0, 5, 8] and step.block_tables is None  # nothing cached
    assert step.logits_indices.tolist() == [4, 5, 6, 7]  # a's last position, every one of b's
    warm = Sequence([0] * 6, block_size=4)
    warm.num_scheduled_tokens = 6
    assert build_prefill([warm], 4).slot_mapping.tolist() == [-1] * 6  # no blocks: nothing is stored


def test_build_decode():
    a, b = Sequence(list(range(10)), block_size=4), Sequence(list(range(5)), block_size=4)
    a.block_table, b.block_table = [7, 2, 5], [1, 0]
    step = build_decode([a, b], 4)
    assert step.input_ids.tolist() == [9, 4] and step.positions.tolist() == [9, 4]
    assert step.slot_mapping.tolist() == [5 * 4 + 1, 0 * 4 + 0]
    assert step.context_lens.tolist() == [10, 5] and step.prev_rows is None
    assert step.block_tables.tolist() == [[7, 2, 5], [1, 0, -1]]
    b.append_placeholder()  # b's token is still on the device, at row 3 of the step in flight
    b.inflight_row = 3
    b.block_table.append(6)
    step = build_decode([a, b], 4)
    assert step.prev_rows.tolist() == [-1, 3] and step.positions.tolist() == [9, 5]
    assert step.slot_mapping.tolist() == [21, 6 * 4 + 1]  # position 5: block 6 (its third), offset 1


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
