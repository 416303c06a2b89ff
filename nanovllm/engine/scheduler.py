"""Scheduling policy: prefill first (only a batch's first sequence may be chunked), else decode all
running sequences, preempting the newest when blocks run out. A step is ``schedule``, ``launched``
and ``postprocess``; async scheduling schedules and launches the next step between the last two."""
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
    """One forward's sequences in batch order; ``kept_rows``: every row but a mid-prompt chunk's."""
    seqs: list[Sequence]
    is_prefill: bool
    kept_rows: list[int] = field(init=False)
    num_tokens: int = field(init=False)  # nano-vllm's count: prefill tokens, or minus the decodes
    step_input: StepInput | None = None

    def __post_init__(self):
        self.kept_rows = [row for row, seq in enumerate(self.seqs)
                          if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens]
        self.num_tokens = (sum(seq.num_scheduled_tokens for seq in self.seqs) if self.is_prefill
                           else -len(self.seqs))

    def drop(self, dropped) -> None:  # in place: the caller's batch is the one launched
        self.seqs = [seq for seq in self.seqs if seq not in dropped]
        self.__post_init__()


class Scheduler:
    def __init__(self, config: Config):
        self.max_num_seqs, self.max_model_len = config.max_num_seqs, config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_prefix_caching = config.enable_prefix_caching
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
        self.waiting, self.running = deque[Sequence](), deque[Sequence]()
        self.held: dict[int, list[Sequence]] = {}  # seq_id -> its siblings (see add)
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence, siblings: list[Sequence] = ()):
        """Queues ``seq``; its ``siblings`` (other completions) wait until its prompt is cached."""
        self.waiting.append(seq)
        if siblings:
            self.held[seq.seq_id] = list(siblings)

    def schedule(self) -> SchedulerOutput:
        """A prefill if one fits, else a decode: empty only if all running ones end in flight."""
        scheduled, budget = [], self.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted with a token in flight: its ids are not all known yet
            if not seq.block_table:  # (prompt logprobs need every position computed, as vLLM)
                use_cache = self.enable_prefix_caching and seq.prompt_logprobs is None
                if not self.block_manager.allocate(seq, use_cache):
                    break
                if seq.num_prefix_cached_tokens is None:  # not a recomputation
                    seq.num_prefix_cached_tokens = seq.num_cached_tokens
            num_tokens = seq.num_tokens - seq.num_cached_tokens
            if num_tokens > budget and scheduled:
                break  # only the first sequence of a batch is chunked
            seq.num_scheduled_tokens = min(num_tokens, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < num_tokens:
                break  # chunked: stays first in line
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
        if scheduled:
            return SchedulerOutput(scheduled, True)
        visited: list[Sequence] = []  # the running ones taken, in order
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            if self._ends_in_flight(seq):
                visited.append(seq)  # stays running until its last token is read back
                continue
            while not self.block_manager.allocate_slot(seq):
                if self.running:
                    self.preempt(self.running.pop())
                elif ending := next(filter(self._ends_in_flight, reversed(visited)), None):
                    visited.remove(ending)  # nothing to recompute
                    self.preempt(ending)
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
                visited.append(seq)
        self.running.extendleft(reversed(visited))
        return SchedulerOutput(scheduled, False)

    def _ends_in_flight(self, seq: Sequence) -> bool:  # its pending token is surely its last
        return seq.num_pending_tokens > 0 and (
            seq.num_completion_tokens >= seq.sampling_params.max_tokens
            or seq.num_tokens >= self.max_model_len)

    def preempt(self, seq: Sequence):
        self.num_preemptions += 1
        seq.status, seq.num_scheduled_tokens = SequenceStatus.WAITING, 0
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def launched(self, batch: SchedulerOutput):
        """Books the issued forward: its scheduled tokens count as cached, kept rows' as pending."""
        for seq in batch.seqs:
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq)  # now, so that the next schedule can hit them
        for row in batch.kept_rows:
            batch.seqs[row].num_pending_tokens += 1

    def postprocess(self, batch: SchedulerOutput, token_ids: list[int], logprobs: list[dict | None],
                    prompt_logprobs: list[tuple[int, list[dict]] | None] | None = None
                    ) -> list[tuple[Sequence, int]]:
        """Appends sampled tokens, prompt logprobs; (sequence, token) for each that gained one."""
        for seq, computed in zip(batch.seqs, prompt_logprobs or ()):
            if computed is not None:
                first, entries = computed
                seq.prompt_logprobs[first:first + len(entries)] = entries
        advanced = []
        for row in batch.kept_rows:
            seq = batch.seqs[row]
            if seq.is_finished:
                continue
            if token_ids[row] >= 0:  # -1: the logits were not finite; the core ends ``seq``
                seq.resolve(token_ids[row])
                if logprobs[row] is not None:
                    seq.logprobs.append(logprobs[row])
            advanced.append((seq, token_ids[row]))
            self.block_manager.hash_blocks(seq)  # before finish frees a block ending in it
        for seq in batch.seqs if batch.is_prefill else ():
            if seq.num_cached_tokens >= seq.num_prompt_tokens:
                self.waiting.extend(self.held.pop(seq.seq_id, ()))
        return advanced

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None):
        """Ends ``seq`` at its last known token (dropping one in flight); starts those it held."""
        if seq.is_finished:
            return
        queue = self.running if seq.status == SequenceStatus.RUNNING else self.waiting
        if seq in queue:
            queue.remove(seq)
        else:  # a held completion, never scheduled
            for held in self.held.values():
                if seq in held:
                    held.remove(seq)
        seq.status, seq.finish_time = SequenceStatus.FINISHED, time.perf_counter()
        seq.finish_reason, seq.stop_reason, seq.num_pending_tokens = reason, stop_reason, 0
        self.block_manager.deallocate(seq)
        self.waiting.extend(self.held.pop(seq.seq_id, ()))
