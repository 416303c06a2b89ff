"""Scheduling policy: prefill first (only the first sequence of a batch may be chunked),
otherwise decode every running sequence; when blocks run out, preempt the newest one."""
from __future__ import annotations

from collections import deque

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = frozenset(config.eos_token_ids)
        # a sequence stops at max_model_len, and never outgrows the whole cache (it could not be scheduled)
        self.max_model_len = min(config.max_model_len, config.num_kvcache_blocks * config.kvcache_block_size)
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Returns the sequences of the next forward and whether it is a prefill."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        scheduled = self._schedule_decode()
        assert scheduled, "no sequence could be scheduled"
        return scheduled, False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        # max_num_seqs caps the running sequences, so that one decode step always covers them all
        while self.waiting and budget > 0 and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
            num_tokens = seq.num_tokens - seq.num_cached_tokens
            if num_tokens > budget and scheduled:
                break  # only the first sequence of a batch is chunked
            seq.num_scheduled_tokens = min(num_tokens, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < num_tokens:
                break  # chunked: stays first in line for the next step
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def preempt(self, seq: Sequence):
        """Free all of ``seq``'s blocks; it is recomputed (prompt and output so far) later."""
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        for seq, token_id in zip(seqs, token_ids):
            num_cached_before = seq.num_cached_tokens
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq, num_cached_before)
            if seq.num_cached_tokens < seq.num_tokens:
                continue  # a prefill chunk: its sampled token is not the next one
            seq.append_token(token_id)
            if ((not seq.ignore_eos and token_id in self.eos_token_ids) or seq.num_completion_tokens == seq.max_tokens
                    or seq.num_tokens == self.max_model_len):
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
