"""Property-based tests of the engine's step loop (``EngineCore`` with its Scheduler and BlockManager,
the real batch builder) under random load, with a fake runner in place of the device.

The fake model's next token is a hash of the whole history, so a correct engine produces the
same outputs whatever the batching, chunking, preemption, prefix caching, async overlap, penalty
sync points or ``n``; a plain Python loop is the reference. After every step the block accounting is
checked against the sequences.
"""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.engine.core import EngineCore, Request, Resources
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.sampling_params import SamplingParams

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
    """The sequence as the device knows it: each placeholder holds the token the fake model sampled."""
    history: list[int] = []
    for token in seq.token_ids:
        history.append(fake_next(history) if token == PLACEHOLDER else token)
    return history


def fake_forward(batch: list[Sequence], step, inflight) -> list[int]:
    """The fake device: checks that the forward's inputs are known where the engine needs them
    (prefill tokens on the host; a decode input pending only from the step in flight, and marked so in
    the step input), and samples."""
    for row, seq in enumerate(batch):
        scheduled = seq.token_ids[seq.num_cached_tokens:seq.num_cached_tokens + seq.num_scheduled_tokens]
        if step.is_prefill:
            assert PLACEHOLDER not in scheduled
        else:  # a sequence whose in-flight token is certainly its last is not computed further
            assert seq.num_completion_tokens < seq.sampling_params.max_tokens
            pending = step.prev_rows is not None and step.prev_rows[row] >= 0
            assert pending == bool(seq.num_pending_tokens)
        if not step.is_prefill and seq.num_pending_tokens:
            assert seq.num_pending_tokens == 1 and scheduled == [PLACEHOLDER]
            assert inflight is not None and inflight[0].seqs[seq.inflight_row] is seq
            assert step.prev_rows[row] == seq.inflight_row and step.input_ids[row] == PLACEHOLDER
    return [fake_next(device_history(seq)[:seq.num_cached_tokens + seq.num_scheduled_tokens]) for seq in batch]


class FakeRunner:
    """Rank 0's runner without a model: ``run`` samples the fake model for the sequences whose sampling
    inputs were prepared last (the core prepares them right before it launches)."""

    def __init__(self):
        self.core: EngineCore | None = None
        self.seqs: list[Sequence] = []

    def prepare_sampling(self, seqs: list[Sequence], is_prefill: bool):
        self.seqs = list(seqs)
        return None

    def run(self, step, sampling):
        return FakeSampled(fake_forward(self.seqs, step, self.core.inflight))

    def exit(self):
        pass


class FakeSampled:
    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids

    def result(self, alive=None):
        return self.token_ids, [None] * len(self.token_ids), None


def run(prompts, max_tokens, num_blocks, block_size, budget, max_num_seqs, prefix_caching, max_len=10_000,
        async_scheduling=False, n=None, penalties=None):
    """EngineCore's step loop around a fake runner. With async_scheduling the next step is scheduled and
    launched before the last one's tokens are read. Returns every completion's tokens (prompt by prompt,
    its n completions in order) and the length limit in force."""
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, eos_token_ids=(EOS,),
                             max_model_len=max_len, num_kvcache_blocks=num_blocks, kvcache_block_size=block_size,
                             enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling, device="cpu")
    resources = Resources()
    resources.runner = runner = FakeRunner()
    core = runner.core = EngineCore(config, resources, resources.close)
    seqs = []
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        sp = SamplingParams(max_tokens=m, presence_penalty=0.5 if penalties and penalties[i] else 0.0)
        request_seqs = [Sequence(prompt, sp, block_size) for _ in range(n[i] if n else 1)]
        core.add(Request(i, prompt, request_seqs, waiting_siblings=request_seqs[1:]))
        seqs += request_seqs
    for _ in range(100_000):
        if core.is_finished():
            break
        core.step()
        check_invariants(core.scheduler, [s for s in seqs if not s.is_finished])
    assert core.is_finished() and all(seq.is_finished for seq in seqs), "the engine made no progress"
    assert not core.scheduler.block_manager.used_block_ids
    assert all(PLACEHOLDER not in seq.token_ids for seq in seqs)
    return [seq.completion_token_ids for seq in seqs], core.scheduler.max_model_len


prompt_lists = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=prompt_lists, data=st.data(), block_size=st.sampled_from([2, 4, 8]),
       num_blocks=st.integers(4, 40), budget=st.integers(1, 64), max_num_seqs=st.integers(1, 8),
       prefix_caching=st.booleans(), async_scheduling=st.booleans())
def test_random_load_keeps_accounting_and_outputs(prompts, data, block_size, num_blocks, budget, max_num_seqs,
                                                   prefix_caching, async_scheduling):
    capacity = num_blocks * block_size
    prompts = [p for p in prompts if len(p) + 1 <= capacity] or [[0]]
    max_tokens = data.draw(st.lists(st.integers(1, 25), min_size=len(prompts), max_size=len(prompts)))
    n = data.draw(st.lists(st.integers(1, 3), min_size=len(prompts), max_size=len(prompts)))
    penalties = data.draw(st.lists(st.booleans(), min_size=len(prompts), max_size=len(prompts)))
    outputs, max_len = run(prompts, max_tokens, num_blocks, block_size, budget, max_num_seqs, prefix_caching,
                           async_scheduling=async_scheduling, n=n, penalties=penalties)
    expected = [reference(prompt, m, max_len) for prompt, m, k in zip(prompts, max_tokens, n) for _ in range(k)]
    assert outputs == expected


@settings(max_examples=40, deadline=None)
@given(prompts=prompt_lists, block_size=st.sampled_from([2, 4]))
def test_outputs_do_not_depend_on_features(prompts, block_size):
    """Prefix caching, chunked prefill, preemption and async scheduling on or off: the same outputs."""
    max_tokens = [5 + len(p) % 7 for p in prompts]
    plain, _ = run(prompts, max_tokens, 1000, block_size, 4096, 64, False)
    small = (max(map(len, prompts)) + 13) // block_size + 2
    squeezed, _ = run(prompts, max_tokens, small, block_size, 3, 3, True)
    overlapped, _ = run(prompts, max_tokens, small, block_size, 3, 3, True, async_scheduling=True)
    assert plain == squeezed == overlapped
