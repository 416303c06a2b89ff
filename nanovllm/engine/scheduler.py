"""Scheduling policy: prefill first (only the first sequence of a batch may be chunked),
otherwise decode every running sequence; when blocks run out, preempt the newest one."""
from __future__ import annotations

import time
from collections import deque

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.enable_prefix_caching = config.enable_prefix_caching
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
        # max_num_seqs caps the running sequences (a fully scheduled one joins them at once; a chunked one
        # ends the batch), so that one decode step always covers them all
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq, self.enable_prefix_caching)
                if seq.num_prefix_cached_tokens is None:  # first admission (not a recomputation)
                    seq.num_prefix_cached_tokens = seq.num_cached_tokens
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

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], logprobs: list[dict | None]) -> list[Sequence]:
        """Appends each sampled token and finishes sequences; returns those that got a token."""
        advanced = []
        for seq, token_id, token_logprobs in zip(seqs, token_ids, logprobs):
            num_cached_before = seq.num_cached_tokens
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq, num_cached_before)
            if seq.num_cached_tokens < seq.num_tokens:
                continue  # a prefill chunk: its sampled token is not the next one
            seq.append_token(token_id)
            if token_logprobs is not None:
                seq.logprobs.append(token_logprobs)
            advanced.append(seq)
            reason = self._finish_reason(seq, token_id)
            if reason:
                self.finish(seq, reason)
        return advanced

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        sp = seq.sampling_params
        if seq.num_completion_tokens >= sp.min_tokens and (
                (not sp.ignore_eos and token_id in self.eos_token_ids) or token_id in sp.stop_token_ids):
            return "stop"
        if seq.num_completion_tokens == sp.max_tokens or seq.num_tokens == self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str):
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
