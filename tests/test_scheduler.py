"""Specification of the scheduler: Sequence and its slot mapping, batch building
(``nanovllm.engine.batch``), the BlockManager (prefix cache, reference counts), the Scheduler's
admission and caps, and a property test of the step loop (EngineCore with its Scheduler and
BlockManager) under random load."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from conftest import ENGINE, assert_no_leaks, random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm import LLM
from nanovllm.engine.batch import prepare_decode, prepare_prefill
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.core import EngineCore
from nanovllm.engine.outputs import Request
from nanovllm.engine.overlap import OverlapEngineCore
from nanovllm.engine.sampling import LogitsHook
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.worker_group import EngineResources
from nanovllm.sampling_params import SamplingParams


# ---- batch building: slot mapping (a worked example), prefill and decode steps -------------------
def test_slot_mapping_worked_example():
    # block_table [4, 5, 9, 3, 11], block_size 8, tokens [1, 38) scheduled:
    # slot = table[p // 8] * 8 + p % 8
    seq = Sequence(list(range(38)), block_size=8)
    seq.block_table = [4, 5, 9, 3, 11]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 1, 37
    step = prepare_prefill([seq], 8)  # a pure function of the sequences: no runner, no model
    expected = [*range(33, 40), *range(40, 48), *range(72, 80), *range(24, 32), *range(88, 94)]
    assert step.slot_mapping.tolist() == expected
    assert step.input_ids.tolist() == list(range(1, 38)) \
        and step.positions.tolist() == list(range(1, 38))
    assert step.cu_seqlens_q.tolist() == [0, 37] and step.cu_seqlens_k.tolist() == [0, 38]
    # keys partly cached: block tables needed
    assert step.block_tables.tolist() == [[4, 5, 9, 3, 11]]
    assert step.max_seqlen_q == 37 and step.max_seqlen_k == 38 \
        and step.logits_indices.tolist() == [36]
    # every slot is block_table[p // bs] * bs + p % bs
    assert expected == [seq.block_table[p // 8] * 8 + p % 8 for p in range(1, 38)]


def test_prefill_of_several_sequences_and_the_warmup():
    a, b = Sequence(list(range(5)), block_size=4), Sequence(list(range(10, 13)), block_size=4)
    a.block_table, b.block_table = [3, 1], [2]
    a.num_scheduled_tokens, b.num_scheduled_tokens = 5, 3
    # b computes its prompt logprobs: the LM head projects all its positions
    b.prompt_logprobs = [None] * 3
    step = prepare_prefill([a, b], 4)
    assert step.input_ids.tolist() == [0, 1, 2, 3, 4, 10, 11, 12]
    assert step.slot_mapping.tolist() == [12, 13, 14, 15, 4, 8, 9, 10]
    assert step.cu_seqlens_q.tolist() == [0, 5, 8] and step.block_tables is None  # nothing cached
    assert step.logits_indices.tolist() == [4, 5, 6, 7]  # a's last position, every one of b's
    warm = Sequence([0] * 6, block_size=4)
    warm.num_scheduled_tokens = 6
    # no blocks: nothing is stored
    assert prepare_prefill([warm], 4).slot_mapping.tolist() == [-1] * 6


def test_prepare_decode():
    a, b = Sequence(list(range(10)), block_size=4), Sequence(list(range(5)), block_size=4)
    a.block_table, b.block_table = [7, 2, 5], [1, 0]
    step = prepare_decode([a, b], 4)
    assert step.input_ids.tolist() == [9, 4] and step.positions.tolist() == [9, 4]
    assert step.slot_mapping.tolist() == [5 * 4 + 1, 0 * 4 + 0]
    assert step.context_lens.tolist() == [10, 5] and step.prev_rows is None
    assert step.block_tables.tolist() == [[7, 2, 5], [1, 0, -1]]
    b.num_pending_tokens = 1  # b's token is still on the device, at row 3 of the step in flight
    b.block_table.append(6)
    # row 2: a chunk
    inflight = SimpleNamespace(seqs=[Sequence([1]), Sequence([2]), a, b], kept_rows=[0, 1, 3])
    step = prepare_decode([a, b], 4, inflight)
    assert step.prev_rows.tolist() == [-1, 3] and step.positions.tolist() == [9, 5]
    assert step.input_ids.tolist() == [9, -1] and step.context_lens.tolist() == [10, 6]
    # a pending token is counted, not stored
    assert b.token_ids == list(range(5)) and b.num_tokens == 6
    # position 5: block 6 (its third), offset 1
    assert step.slot_mapping.tolist() == [21, 6 * 4 + 1]


# ---- block manager -------------------------------------------------------------------------------
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
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1] \
        and c.num_cached_tokens == 4
    for seq in (a, b, c):
        bm.deallocate(seq)
    assert len(bm.free_block_ids) == 8 and all(blk.ref_count == 0 for blk in bm.blocks)
    # freed blocks keep their contents for later hits
    d = Sequence(list(range(9)), block_size=4)
    bm.allocate(d)
    assert d.num_cached_tokens == 8


# ---- scheduler: admission counts the blocks a sequence needs, max_num_seqs caps the running set --
def test_running_sequences_capped_by_max_num_seqs(tiny):
    engine = LLM(tiny, **{**ENGINE, "max_num_seqs": 3})
    try:
        for prompt in random_prompts(7, 3, 20, seed=13):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
            assert len(engine.scheduler.running) <= 3
        assert_no_leaks(engine)
    finally:
        engine.exit()


def test_completions_of_one_long_prompt_run_together(tiny):
    """n=2 of a 100-token prompt (6 full blocks + 1) in a 12-block cache: the second completion
    needs one new block, not seven, so both run at once."""
    llm = LLM(tiny, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=12)
    running = []
    schedule = llm.scheduler.schedule

    def spy():
        out = schedule()
        running.append(len(llm.scheduler.running))
        return out

    llm.scheduler.schedule = spy
    try:
        prompt = random_prompts(1, 100, 100, seed=75)[0]
        out = llm.generate([prompt],
                           SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)[0]
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert max(running) == 2
    assert out["outputs"][0]["token_ids"] == out["outputs"][1]["token_ids"] \
        and len(out["token_ids"]) == 20


# ---- property-based tests of the step loop -------------------------------------------------------
# EngineCore with its Scheduler and BlockManager, the real batch builder, under random load, with a
# fake runner in place of the device. The fake model's next token is a hash of the whole history, so
# a correct engine produces the same outputs whatever the batching, chunking, preemption, prefix
# caching, async overlap, penalty sync points or ``n``; a plain Python loop is the reference. After
# every step the block accounting is checked against the sequences.
VOCAB, EOS = 7, 6


def fake_next(history: list[int]) -> int:
    return hash(tuple(history)) % VOCAB


def reference(prompt: list[int], max_tokens: int, max_len: int) -> list[int]:
    tokens = list(prompt)
    while True:
        tokens.append(fake_next(tokens))
        out = tokens[len(prompt):]
        if out[-1] == EOS or len(out) == max_tokens or len(tokens) == max_len:
            return out


def check_invariants(scheduler: Scheduler, live: list[Sequence]):
    bm = scheduler.block_manager
    assert not (set(bm.free_block_ids) & bm.used_block_ids)
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == len(bm.blocks)
    assert len(set(bm.free_block_ids)) == len(bm.free_block_ids)  # no double free
    holders = Counter(b for seq in live for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert (block.ref_count > 0) == (block.block_id in bm.used_block_ids)
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h
    assert len(bm.hash_to_block_id) <= len(bm.blocks)


def device_history(seq: Sequence) -> list[int]:
    """The sequence as the device knows it: its known tokens, then each pending one as the fake
    model sampled it."""
    history = list(seq.token_ids)
    for _ in range(seq.num_pending_tokens):
        history.append(fake_next(history))
    return history


def fake_forward(batch: list[Sequence], step, inflight) -> list[int]:
    """The fake device: checks that the forward's inputs are known where the engine needs them
    (prefill tokens on the host; a decode input pending only from the step in flight, and marked so
    in the step input), and samples."""
    for row, seq in enumerate(batch):
        if step.is_prefill:  # every scheduled token is known on the host
            assert seq.num_pending_tokens == 0
            assert seq.num_cached_tokens + seq.num_scheduled_tokens <= len(seq.token_ids)
        else:  # a sequence whose in-flight token is certainly its last is not computed further
            assert seq.num_completion_tokens < seq.sampling_params.max_tokens
            pending = step.prev_rows is not None and step.prev_rows[row] >= 0
            assert pending == bool(seq.num_pending_tokens)
        # its input is the in-flight step's sample
        if not step.is_prefill and seq.num_pending_tokens:
            assert seq.num_pending_tokens == 1 and seq.num_cached_tokens == len(seq.token_ids)
            prev_row = step.prev_rows[row]
            assert inflight is not None and prev_row in inflight[0].kept_rows \
                and inflight[0].seqs[prev_row] is seq
            assert step.input_ids[row] == -1
    return [fake_next(device_history(seq)[:seq.num_cached_tokens + seq.num_scheduled_tokens])
            for seq in batch]


class FakeRunner:
    """Rank 0's runner without a model: ``forward`` samples the fake model for the sequences whose
    sampling inputs were prepared last (the core prepares them right before it launches)."""

    def __init__(self):
        self.core: EngineCore | None = None
        self.seqs: list[Sequence] = []
        self.sampling = LogitsHook()  # no per-sequence sampling state to forget

    def prepare_sample(self, batch):
        self.seqs = list(batch.seqs)
        return None

    def forward(self, step, sampling):
        return fake_forward(self.seqs, step, self.core.inflight)

    def sample(self, step, token_ids, sampling):
        return FakeSampled(token_ids)

    def exit(self):
        pass


class FakeSampled:
    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids

    def result(self, alive=None):
        return self.token_ids, [None] * len(self.token_ids), None


def run(prompts, max_tokens, num_blocks, block_size, budget, max_num_seqs, prefix_caching,
        max_len=10_000, async_scheduling=False, n=None, penalties=None):
    """EngineCore's step loop around a fake runner. With async_scheduling the next step is scheduled
    and launched before the last one's tokens are read. Returns every completion's tokens (prompt by
    prompt, its n completions in order) and the length limit in force."""
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             eos_token_ids=(EOS,),
                             # as the model runner lowers it: no more than the whole cache holds
                             max_model_len=min(max_len, num_blocks * block_size),
                             num_kvcache_blocks=num_blocks, kvcache_block_size=block_size,
                             disable_cascade_attn=False,
                             enable_prefix_caching=prefix_caching,
                             async_scheduling=async_scheduling, device="cpu")
    resources = EngineResources()
    resources.runner = runner = FakeRunner()
    core_class = OverlapEngineCore if async_scheduling else EngineCore
    core = runner.core = core_class(config, resources, resources.close, [])
    seqs = []
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        sp = SamplingParams(max_tokens=m,
                            presence_penalty=0.5 if penalties and penalties[i] else 0.0)
        request_seqs = [Sequence(prompt, sp, block_size) for _ in range(n[i] if n else 1)]
        core.add(Request(i, prompt, request_seqs), sp)
        seqs += request_seqs
    for _ in range(100_000):
        if core.is_finished():
            break
        core.step()
        check_invariants(core.scheduler, [s for s in seqs if not s.is_finished])
    assert core.is_finished() and all(seq.is_finished for seq in seqs), \
        "the engine made no progress"
    assert not core.scheduler.block_manager.used_block_ids
    assert all(seq.num_pending_tokens == 0 for seq in seqs)
    return [seq.completion_token_ids for seq in seqs], core.scheduler.max_model_len


prompt_lists = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1,
                        max_size=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=prompt_lists, data=st.data(), block_size=st.sampled_from([2, 4, 8]),
       num_blocks=st.integers(4, 40), budget=st.integers(1, 64), max_num_seqs=st.integers(1, 8),
       prefix_caching=st.booleans(), async_scheduling=st.booleans())
def test_random_load_keeps_accounting_and_outputs(prompts, data, block_size, num_blocks, budget,
                                                   max_num_seqs, prefix_caching, async_scheduling):
    capacity = num_blocks * block_size
    prompts = [p for p in prompts if len(p) + 1 <= capacity] or [[0]]
    max_tokens = data.draw(st.lists(st.integers(1, 25), min_size=len(prompts),
                                    max_size=len(prompts)))
    n = data.draw(st.lists(st.integers(1, 3), min_size=len(prompts), max_size=len(prompts)))
    penalties = data.draw(st.lists(st.booleans(), min_size=len(prompts), max_size=len(prompts)))
    outputs, max_len = run(prompts, max_tokens, num_blocks, block_size, budget, max_num_seqs,
                           prefix_caching, async_scheduling=async_scheduling, n=n,
                           penalties=penalties)
    expected = [reference(prompt, m, max_len) for prompt, m, k in zip(prompts, max_tokens, n)
                for _ in range(k)]
    assert outputs == expected


@settings(max_examples=40, deadline=None)
@given(prompts=prompt_lists, block_size=st.sampled_from([2, 4]))
def test_outputs_do_not_depend_on_features(prompts, block_size):
    """Prefix caching, chunked prefill, preemption and async scheduling on or off: the same
    outputs."""
    max_tokens = [5 + len(p) % 7 for p in prompts]
    plain, _ = run(prompts, max_tokens, 1000, block_size, 4096, 64, False)
    small = (max(map(len, prompts)) + 13) // block_size + 2
    squeezed, _ = run(prompts, max_tokens, small, block_size, 3, 3, True)
    overlapped, _ = run(prompts, max_tokens, small, block_size, 3, 3, True, async_scheduling=True)
    assert plain == squeezed == overlapped
