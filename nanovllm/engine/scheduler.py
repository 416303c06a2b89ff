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
from dataclasses import dataclass, field

from nanovllm.config import Config
from nanovllm.engine.batch import StepInput
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What the scheduler hands the runner: one forward's sequences in batch order. ``kept_rows`` are the rows
    whose sampled token is the sequence's next (all but a prefill chunk short of its prompt's end), computed
    once, when the batch is scheduled; ``step_input`` is the batch as arrays (``batch.prepare_prefill``/
    ``prepare_decode``)."""

    seqs: list[Sequence]
    is_prefill: bool
    kept_rows: list[int] = field(init=False)
    step_input: StepInput | None = None

    def __post_init__(self):
        self.kept_rows = [row for row, seq in enumerate(self.seqs)
                          if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens]

    def without(self, dropped) -> SchedulerOutput:
        """The same batch less the sequences in ``dropped`` (ended before it was launched)."""
        return SchedulerOutput([seq for seq in self.seqs if seq not in dropped], self.is_prefill)


class Scheduler:
    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_prefix_caching = config.enable_prefix_caching
        self.max_model_len = config.max_model_len  # the model runner keeps it within what the whole cache holds
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.held: dict[int, list[Sequence]] = {}  # seq_id -> completions that start once its prompt is cached
        self.num_preemptions = 0  # over the engine's life

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence, siblings: list[Sequence] = ()):
        """Queues ``seq``; its ``siblings`` (the request's other completions) are held until ``seq``'s prompt
        is in the cache, so that they find its blocks there."""
        self.waiting.append(seq)
        if siblings:
            self.held[seq.seq_id] = list(siblings)

    def schedule(self) -> SchedulerOutput:
        """The next forward: a prefill if any waiting sequence fits, else a decode of the running ones. Empty only
        when every running sequence is waiting for the result of a forward in flight."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return SchedulerOutput(scheduled, True)
        return SchedulerOutput(self._schedule_decode(), False)

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

    def launched(self, batch: SchedulerOutput):
        """Books the forward just issued: its scheduled tokens count as cached (the device writes their K/V before
        any later forward reads them), and each kept row's token as pending."""
        for seq in batch.seqs:
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq)  # now, so that the very next schedule can reuse them
        for row in batch.kept_rows:
            batch.seqs[row].num_pending_tokens += 1

    def postprocess(self, batch: SchedulerOutput, token_ids: list[int], logprobs: list[dict | None],
                    prompt_logprobs: list[tuple[int, list[dict]] | None] | None = None) -> list[tuple[Sequence, int]]:
        """Appends the batch's sampled tokens (and prompt logprobs: per sequence, its first position and the
        entries); returns (sequence, token) for each sequence that gained one. A sequence that finished on an
        earlier token ignores this one (it was computed before that was known)."""
        for seq, computed in zip(batch.seqs, prompt_logprobs or ()):
            if computed is not None:
                first, entries = computed
                seq.prompt_logprobs[first:first + len(entries)] = entries
        advanced = []
        for row in batch.kept_rows:
            seq = batch.seqs[row]
            if seq.is_finished:
                continue
            token_id = token_ids[row]
            seq.resolve(token_id)
            if logprobs[row] is not None:
                seq.logprobs.append(logprobs[row])
            advanced.append((seq, token_id))
            self.block_manager.hash_blocks(seq)  # a block whose last id was pending; before finish frees it
        for seq in batch.seqs if batch.is_prefill else ():
            if seq.num_cached_tokens >= seq.num_prompt_tokens:
                self._release_held(seq)
        return advanced

    def _release_held(self, seq: Sequence):
        for sibling in self.held.pop(seq.seq_id, ()):
            self.waiting.append(sibling)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None):
        """Ends ``seq`` at its last known token (a token still in flight is dropped); the completions it held
        start now (the request may go on without it)."""
        if seq.is_finished:
            return
        seq.num_pending_tokens = 0
        queue = self.running if seq.status == SequenceStatus.RUNNING else self.waiting
        if seq in queue:
            queue.remove(seq)
        else:  # a held completion, never scheduled
            for held in self.held.values():
                if seq in held:
                    held.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.finish_time = time.perf_counter()
        self.block_manager.deallocate(seq)
        self._release_held(seq)
