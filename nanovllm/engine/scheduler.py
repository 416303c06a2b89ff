"""Scheduling policy: prefill first (only the first sequence of a batch may be chunked),
otherwise decode every running sequence; when blocks run out, preempt the newest one.

A step has three moments: ``schedule`` picks the sequences, ``launched`` books the forward once
it is issued (each sequence that gets a token counts one more pending token), and ``postprocess``
appends the sampled tokens when they are read back. With async scheduling the next step
is scheduled and launched between the last two, so the CPU works while the device runs.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    """A launched forward: its sequences in batch order, and the rows whose sampled token is kept
    (all of them, except a prefill chunk that does not reach the end of its prompt)."""

    seqs: list[Sequence]
    is_prefill: bool
    rows: list[int]


class Scheduler:
    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_prefix_caching = config.enable_prefix_caching
        self.max_model_len = config.max_model_len  # the model runner keeps it within what the whole cache holds
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0  # over the engine's life

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Returns the sequences of the next forward and whether it is a prefill. Empty only when
        every running sequence is waiting for the result of a forward in flight."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        # max_num_seqs caps the running sequences (a fully scheduled one joins them at once; a chunked one
        # ends the batch), so that one decode step always covers them all
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted with a token in flight: its ids are not all known yet
            if not seq.block_table:
                # prompt logprobs need every prompt position computed: no prompt from the cache (as vLLM)
                use_cache = self.enable_prefix_caching and seq.prompt_logprobs is None
                if not self.block_manager.allocate(seq, use_cache):
                    break
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
        visited: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            if self._ends_in_flight(seq):
                visited.append(seq)  # stays running until its last token is read back
                continue
            while not self.block_manager.allocate_slot(seq):
                if self.running:
                    self.preempt(self.running.pop())
                elif ending := next((s for s in reversed(visited) if self._ends_in_flight(s)), None):
                    visited.remove(ending)  # finishes when its token is read back: nothing to recompute
                    self.preempt(ending)
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
                visited.append(seq)
        self.running.extendleft(reversed(visited))
        return scheduled

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Its pending token is certain to be its last (max_tokens or the length limit): computing
        one more would be wasted."""
        return seq.num_pending_tokens > 0 and (seq.num_completion_tokens >= seq.sampling_params.max_tokens
                                               or seq.num_tokens >= self.max_model_len)

    def preempt(self, seq: Sequence):
        """Free all of ``seq``'s blocks; it is recomputed (prompt and output so far) later."""
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def launched(self, seqs: list[Sequence], is_prefill: bool) -> ScheduledStep:
        """Books the forward just issued for ``seqs``: their scheduled tokens count as cached (the
        device writes their K/V before any later forward reads it), and each sequence whose sampled
        token is kept counts it as pending."""
        rows = []
        for row, seq in enumerate(seqs):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq)  # now, so that the very next schedule can reuse them
            if seq.num_cached_tokens == seq.num_tokens:  # else a prefill chunk: its sample is not a next token
                seq.num_pending_tokens += 1
                rows.append(row)
        return ScheduledStep(seqs, is_prefill, rows)

    def postprocess(self, step: ScheduledStep, token_ids: list[int], logprobs: list[dict | None],
                    prompt_logprobs: list[tuple[int, list[dict]] | None] | None = None) -> list[tuple[Sequence, int]]:
        """Books the step's sampled tokens (and prompt logprobs: per sequence of a prefill, the first
        position they are for and the entries); returns (sequence, token) for each sequence that gained a
        token (the engine core decides which of them it ends). A sequence that finished on an earlier
        token ignores this one (it was computed before that was known) and never shows it."""
        for seq, computed in zip(step.seqs, prompt_logprobs or ()):
            if computed is not None:
                first, entries = computed
                seq.prompt_logprobs[first:first + len(entries)] = entries
        advanced = []
        for row in step.rows:
            seq = step.seqs[row]
            if seq.is_finished:
                continue
            token_id = token_ids[row]
            seq.resolve(token_id)
            if logprobs[row] is not None:
                seq.logprobs.append(logprobs[row])
            advanced.append((seq, token_id))
            self.block_manager.hash_blocks(seq)  # a block whose last id was pending; before finish frees it
        return advanced

    def finish(self, seq: Sequence, reason: str):
        """Ends ``seq`` at its last known token (a token still in flight is dropped)."""
        seq.num_pending_tokens = 0
        (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).remove(seq)  # waiting: preempted
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.block_manager.deallocate(seq)
