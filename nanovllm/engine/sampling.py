"""Rank 0's sampling inputs as device tensors, and the ``LogitsHook`` contract: what shapes a step's
logits beside the sampler's own stages (penalties; a feature's bitmask or logits processors)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanovllm.engine.logprobs import PromptLogprobsBatch, prepare_prompt_logprobs
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplingBatch
from nanovllm.layers.sampling_stages import prepare_stages


@dataclass
class SamplingInputs:
    """What rank 0 needs, besides the logits, to sample one step."""

    batch: SamplingBatch
    prompt: PromptLogprobsBatch | None  # engine.logprobs
    num_logprobs: list[int | None]  # per sequence: its logprobs k, or None
    host_work: list = field(default_factory=list)  # wait() before the read-back, check() after


class LogitsHook:
    """Shapes a step's logits on rank 0, in every step; e.g. to ban token 0, ``prepare`` adds
    ``lambda logits: logits.index_fill_(1, zero, -inf)`` to ``sampling.batch.masks``."""

    def add(self, seqs: list[Sequence], params) -> None:
        """A request's completions are admitted (``params``: its checked ``SamplingParams``)."""

    def needs_known_tokens(self, batch: SchedulerOutput) -> bool:
        """Whether ``batch``'s sampling inputs need the step in flight's tokens."""
        return False

    def prepare(self, batch: SchedulerOutput, sampling: SamplingInputs,
                read_back: Callable[..., None] | None) -> None:
        """Adds to ``sampling`` once the forward is launched; ``read_back(after_accept=None)``
        reads the step in flight back (None when there is none)."""

    def accept(self, advanced: list[tuple[Sequence, int]]) -> dict[Sequence, Exception]:
        """Follows the tokens just appended; returns the sequences to end, with their error."""
        return {}

    def forget(self, seq: Sequence) -> None:
        """``seq`` has ended."""

    def shutdown(self) -> None:
        """The engine is shutting down."""


class Penalties(LogitsHook):
    """The sampler's penalties read every generated token."""

    def needs_known_tokens(self, batch: SchedulerOutput) -> bool:
        return any(seq.sampling_params.needs_penalties for seq in batch.seqs)


class SamplingPreparer:
    """Builds ``SamplingInputs`` on rank 0's device; holds each seeded sequence's generator."""

    def __init__(self, device: torch.device, vocab_size: int, eos_token_ids):
        self.device, self.vocab_size, self.eos_token_ids = device, vocab_size, set(eos_token_ids)
        self.generators: dict[int, torch.Generator] = {}  # by seq_id

    def to_device(self, values, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Host values on the device, through pinned memory, without waiting."""
        t = torch.as_tensor(values, dtype=dtype, device="cpu")  # on the host under a device context
        t = t.pin_memory() if self.device.type == "cuda" else t
        return t.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def prepare(self, batch: SchedulerOutput) -> SamplingInputs:
        wanted = batch.is_prefill and any(seq.num_prompt_logprob_rows for seq in batch.seqs)
        prompt = prepare_prompt_logprobs(self, batch.seqs) if wanted else None
        return SamplingInputs(self.prepare_sample(batch.seqs, batch.kept_rows), prompt,
                              [seq.sampling_params.logprobs for seq in batch.seqs])

    def prepare_sample(self, seqs: list[Sequence], kept_rows: list[int]) -> SamplingBatch:
        params = [seq.sampling_params for seq in seqs]
        # a temperature below SAMPLING_EPS is greedy (1 / T would overflow the logits)
        temperatures = [0.0 if sp.is_greedy else sp.temperature for sp in params]
        batch = SamplingBatch(self.to_device(temperatures, torch.float32))
        if not all(sp.is_plain for sp in params):
            prepare_stages(self, batch, seqs, params, kept_rows)
        return batch

    def forget(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)
