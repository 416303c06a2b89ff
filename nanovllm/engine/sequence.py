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


class Sequence:
    """``num_pending_tokens`` tokens were sampled by launched forwards but not read back yet (at
    most two); they count in ``num_tokens``, not in ``token_ids``. Tokens ``[0, num_cached_tokens)``
    have their K/V in the cache (or being written); the next forward computes
    ``num_scheduled_tokens`` more."""

    counter = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 block_size: int = 64):  # 64: the Triton and torch backends' default
        self.seq_id = next(Sequence.counter)
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_hashed_blocks = 0  # blocks registered in the prefix cache
        self.num_prefix_cached_tokens: int | None = None
        self.block_table: list[int] = []
        self.sampling_params = sampling_params or SamplingParams()
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] = []
        # entry p for prompt token p (None for the first); only on the completion that computes them
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def is_finished(self):
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self):
        """Generated tokens, the pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self):
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def resolve(self, token_id: int):
        """Appends the oldest pending token, read back from the device."""
        self.token_ids.append(token_id)
        self.num_pending_tokens -= 1
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    @property
    def num_prompt_logprob_rows(self) -> int:
        """How many of the next forward's positions give a prompt logprob (their next token is a
        prompt token)."""
        if self.prompt_logprobs is None:
            return 0
        start = self.num_cached_tokens
        return max(0, min(start + self.num_scheduled_tokens, self.num_prompt_tokens - 1) - start)
