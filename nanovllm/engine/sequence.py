"""One request's state: its token ids, its block table and how many tokens are cached/scheduled."""
from __future__ import annotations

import time
from copy import copy
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


# Stands for a sampled token still on the device (async scheduling): the forward that samples it has
# been launched but its result not yet read. Its value reaches the next forward on the device.
PLACEHOLDER = -1


class Sequence:
    """Tokens ``[0, num_cached_tokens)`` have their K/V in the cache (or being written by a launched
    forward); the next forward computes ``num_scheduled_tokens`` more. ``block_table[i]`` is the
    physical block of logical block i. The last ``num_pending_tokens`` token ids are PLACEHOLDERs
    (at most two: the in-flight step's and, briefly, the one just launched after it)."""

    counter = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None, block_size: int = 256):
        sampling_params = sampling_params or SamplingParams()
        self.seq_id = next(Sequence.counter)
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_pending_tokens = 0
        self.inflight_row = -1             # this sequence's row in the batch of its latest launched forward
        self.num_hashed_blocks = 0         # blocks registered in the prefix cache (BlockManager.hash_blocks)
        self.num_prefix_cached_tokens: int | None = None  # prompt tokens found in the prefix cache
        self.block_table: list[int] = []
        self.sampling_params = sampling_params
        self.generator = None              # set on rank 0 for a seeded request, on first use
        self.finish_reason: str | None = None   # "stop" or "length"
        self.logprobs: list[dict[int, float]] = []
        # Set by the engine on the sequence that computes prompt logprobs (completion 0 of a request that
        # asks): its prefill computes logits at every scheduled position, not only the last. Cleared once
        # every prompt position has been launched (a recomputation after preemption does not redo them).
        self.computes_prompt_logprobs = False
        self.prompt_logprobs: list[dict[int, float] | None] | None = None  # [None, {id: logprob}, ...]
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.detokenizer = None            # an IncrementalDetokenizer when text is needed as it grows

    def __len__(self):
        return self.num_tokens

    @property
    def is_finished(self):
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self):
        """Generated tokens, the pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_resolved_tokens(self):
        return self.num_tokens - self.num_pending_tokens

    @property
    def completion_token_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self):
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self):
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def append_placeholder(self):
        """A launched forward will sample this sequence's next token; ``resolve`` fills it in."""
        self.token_ids.append(PLACEHOLDER)
        self.last_token = PLACEHOLDER
        self.num_tokens += 1
        self.num_pending_tokens += 1

    def resolve(self, token_id: int):
        """The oldest pending token's value, read back from the device."""
        self.token_ids[self.num_tokens - self.num_pending_tokens] = token_id
        self.num_pending_tokens -= 1
        if not self.num_pending_tokens:
            self.last_token = token_id
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    def drop_pending(self):
        """Forget tokens still on the device (the sequence finished before them)."""
        if self.num_pending_tokens:
            del self.token_ids[self.num_resolved_tokens:]
            self.num_tokens -= self.num_pending_tokens
            self.num_pending_tokens = 0
            self.last_token = self.token_ids[-1]

    @property
    def scheduled_token_ids(self) -> list[int]:
        """The tokens the next forward computes: positions [num_cached_tokens, +num_scheduled_tokens)."""
        return self.token_ids[self.num_cached_tokens:self.num_cached_tokens + self.num_scheduled_tokens]
