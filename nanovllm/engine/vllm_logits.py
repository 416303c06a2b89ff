"""vLLM's batch-level logits processors (``nanovllm.logits_processor``) behind the engine's ``LogitsProcessor``
hooks: their batch indices, each step's ``BatchUpdate``, and their ``apply`` handed to the sampler."""
from __future__ import annotations

import torch

from nanovllm import logits_processor as vllm_lp
from nanovllm.engine.sampling import LogitsProcessor, SamplingInputs
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.inputs import require_tokenizer


class VllmLogitsProcessors(LogitsProcessor):
    """The built-ins, then ``Config.logits_processors``; batch index i is row i of the step. Custom ones may read
    any request's output tokens, so a step with them waits for the step in flight."""

    def __init__(self, config, device: torch.device):
        self.classes = [*vllm_lp.BUILTIN_LOGITS_PROCESSORS, *config.logits_processors]
        self.processors = [cls(config, device, device.type == "cuda") for cls in self.classes]
        self.custom, self.vocab_size = bool(config.logits_processors), config.hf_config.vocab_size
        self.rows: list[int] = []  # the seq_id at each batch index, as the processors last saw the batch
        self.outputs: dict[int, list[int]] = {}  # seq_id -> the live output list the processors were given
        self.users: set[int] = set()  # the live seq_ids with allowed_token_ids or bad_words

    def verify(self, params, tokenizer) -> None:
        """At admission: allowed_token_ids in the vocabulary, bad_words tokenized, every ``validate_params``."""
        if bad := [t for t in params.allowed_token_ids or () if t >= self.vocab_size]:
            raise ValueError(f"allowed_token_ids contains out-of-vocab token ids {bad[:5]} (vocabulary size "
                             f"{self.vocab_size})")
        if params.bad_words:
            require_tokenizer(tokenizer, "bad_words")
            params._bad_words_token_ids = vllm_lp.bad_words_token_ids(params.bad_words, tokenizer)
        for cls in self.classes:
            cls.validate_params(params)

    def add(self, seqs: list[Sequence], params) -> None:
        if params.allowed_token_ids or params.bad_words:
            self.users.update(seq.seq_id for seq in seqs)

    def _used(self, batch: SchedulerOutput, *names: str) -> bool:
        return self.custom or bool(self.users) and any(getattr(seq.sampling_params, name) for seq in batch.seqs
                                                       for name in names)

    def needs_known_tokens(self, batch: SchedulerOutput) -> bool:
        return self._used(batch, "bad_words")

    def prepare(self, batch: SchedulerOutput, sampling: SamplingInputs, read_back) -> None:
        used = self._used(batch, "allowed_token_ids", "bad_words")
        if used or self.rows:
            self._update(batch.seqs if used else [])
        if used:
            sampling.batch.logits_transform = self.apply

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for processor in self.processors:
            logits = processor.apply(logits)
        return logits

    def _update(self, seqs: list[Sequence]) -> None:
        """Added requests take the lowest free indices (removed ones' first), then swaps put each at its row."""
        new = {seq.seq_id for seq in seqs}
        slots = [seq_id if seq_id in new else None for seq_id in self.rows] + [None] * len(seqs)  # index -> seq_id
        index = {seq_id: i for i, seq_id in enumerate(slots) if seq_id is not None}
        free, added, moved = (i for i, seq_id in enumerate(slots) if seq_id is None), [], []
        for seq in seqs:
            if seq.seq_id not in index:
                i = index[seq.seq_id] = next(free)
                slots[i] = seq.seq_id
                outputs = self.outputs.setdefault(seq.seq_id, seq.completion_token_ids)
                added.append((i, seq.sampling_params, seq.token_ids[:seq.num_prompt_tokens], outputs))
        removed = [i for i, seq_id in enumerate(self.rows) if slots[i] is None]
        for row, seq in enumerate(seqs):
            if (i := index[seq.seq_id]) != row:
                moved.append((i, row, vllm_lp.MoveDirectionality.SWAP))
                other = slots[row]
                slots[i], slots[row], index[seq.seq_id] = other, seq.seq_id, row
                if other is not None:
                    index[other] = i
        self.rows = [seq.seq_id for seq in seqs]
        update = vllm_lp.BatchUpdate(len(seqs), removed, added, moved) if removed or added or moved else None
        for processor in self.processors:
            processor.update_state(update)

    def accept(self, advanced: list[tuple[Sequence, int]]) -> dict[Sequence, Exception]:
        for seq, token_id in advanced if self.outputs else ():
            if (outputs := self.outputs.get(seq.seq_id)) is not None:
                outputs.append(token_id)
        return {}

    def forget(self, seq: Sequence) -> None:
        self.outputs.pop(seq.seq_id, None)
        self.users.discard(seq.seq_id)
