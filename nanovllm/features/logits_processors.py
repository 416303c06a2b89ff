"""vLLM's batch-level logits processors (``nanovllm.logits_processor``), a feature: installed by
the ``logits_processors`` engine keyword or by a request's ``allowed_token_ids`` / ``bad_words``
(rank 0); a ``LogitsHook`` that keeps their batch indices, builds each step's ``BatchUpdate`` and
hands their ``apply`` to the sampler."""
from __future__ import annotations

import torch

from nanovllm import logits_processor as vllm_lp
from nanovllm.engine.llm_engine import require_tokenizer
from nanovllm.engine.sampling import LogitsHook, SamplingInputs
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.plugins import Feature


class VllmLogitsProcessors(LogitsHook):
    """The built-ins, then the engine's ``logits_processors``; batch index i is row i of the step.
    Custom ones may read any request's output tokens, so a step with them waits for the step in
    flight."""

    def __init__(self, config, device: torch.device, custom: list[type] = ()):
        self.classes = [*vllm_lp.BUILTIN_LOGITS_PROCESSORS, *custom]
        self.processors = [cls(config, device, device.type == "cuda") for cls in self.classes]
        self.custom, self.vocab_size = bool(custom), config.hf_config.vocab_size
        # the seq_id at each batch index, as the processors last saw the batch
        self.rows: list[int] = []
        # seq_id -> the live output list the processors were given
        self.outputs: dict[int, list[int]] = {}
        self.users: set[int] = set()  # the live seq_ids with allowed_token_ids or bad_words
        self.failed: dict[int, Exception] = {}  # seq_id -> the processor error that ends it

    def verify(self, params, tokenizer) -> None:
        """At admission: allowed_token_ids in the vocabulary, bad_words tokenized, every
        ``validate_params``."""
        if bad := [t for t in params.allowed_token_ids or () if t >= self.vocab_size]:
            raise ValueError(f"allowed_token_ids contains out-of-vocab token ids {bad[:5]} "
                             f"(vocabulary size {self.vocab_size})")
        if params.bad_words:
            require_tokenizer(tokenizer, "bad_words")
            params._bad_words_token_ids = vllm_lp.bad_words_token_ids(params.bad_words, tokenizer)
        for cls in self.classes:
            cls.validate_params(params)

    def add(self, seqs: list[Sequence], params) -> None:
        if params.allowed_token_ids or params.bad_words:
            self.users.update(seq.seq_id for seq in seqs)

    def _used(self, batch: SchedulerOutput, *names: str) -> bool:
        return self.custom or bool(self.users) and any(getattr(seq.sampling_params, name)
                                                       for seq in batch.seqs for name in names)

    def needs_known_tokens(self, batch: SchedulerOutput) -> bool:
        return self._used(batch, "bad_words")

    def prepare(self, batch: SchedulerOutput, sampling: SamplingInputs, read_back) -> None:
        used = self._used(batch, "allowed_token_ids", "bad_words")
        if used or self.rows:
            self._update(batch.seqs if used else [])
        if used:
            sampling.batch.transforms.append(self.apply)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Each processor's ``apply`` in turn. One that raises, or returns anything but a tensor of
        the logits' shape (a single row would be broadcast to every request), fails this step's
        requests with an error naming it: their logits become NaN (the step samples no token for
        them), ``accept`` ends them with that error, and the engine serves on."""
        for processor in self.processors:
            shape, name = logits.shape, f"logits processor {type(processor).__qualname__}.apply"
            try:
                out = processor.apply(logits)
            except Exception as e:
                error = RuntimeError(f"{name} raised {type(e).__name__}: {e}")
            else:
                if isinstance(out, torch.Tensor) and out.shape == shape:
                    logits = out
                    continue
                got = (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
                       else f"{out!r:.60}")
                error = ValueError(f"{name} must return the logits' shape {tuple(shape)}, "
                                   f"got {got}")
            self.failed.update(dict.fromkeys(self.rows, error))
            return torch.full_like(logits, float("nan"))  # no token: the sampler marks the rows
        return logits

    def _update(self, seqs: list[Sequence]) -> None:
        """Added requests take the lowest free indices (removed ones' first), then swaps put each at
        its row."""
        new = {seq.seq_id for seq in seqs}
        # index -> seq_id
        slots = [seq_id if seq_id in new else None for seq_id in self.rows] + [None] * len(seqs)
        index = {seq_id: i for i, seq_id in enumerate(slots) if seq_id is not None}
        free, added, moved = (i for i, seq_id in enumerate(slots) if seq_id is None), [], []
        for seq in seqs:
            if seq.seq_id not in index:
                i = index[seq.seq_id] = next(free)
                slots[i] = seq.seq_id
                outputs = self.outputs.setdefault(seq.seq_id, seq.completion_token_ids)
                added.append((i, seq.sampling_params, seq.token_ids[:seq.num_prompt_tokens],
                              outputs))
        removed = [i for i, seq_id in enumerate(self.rows) if slots[i] is None]
        for row, seq in enumerate(seqs):
            if (i := index[seq.seq_id]) != row:
                moved.append((i, row, vllm_lp.MoveDirectionality.SWAP))
                other = slots[row]
                slots[i], slots[row], index[seq.seq_id] = other, seq.seq_id, row
                if other is not None:
                    index[other] = i
        self.rows = [seq.seq_id for seq in seqs]
        update = (vllm_lp.BatchUpdate(len(seqs), removed, added, moved)
                  if removed or added or moved else None)
        for processor in self.processors:
            processor.update_state(update)

    def accept(self, advanced: list[tuple[Sequence, int]]) -> dict[Sequence, Exception]:
        for seq, token_id in advanced if self.outputs else ():
            if (outputs := self.outputs.get(seq.seq_id)) is not None:
                outputs.append(token_id)
        if not self.failed:  # almost every step
            return {}
        return {seq: self.failed.pop(seq.seq_id) for seq, _ in advanced
                if seq.seq_id in self.failed}

    def forget(self, seq: Sequence) -> None:
        self.outputs.pop(seq.seq_id, None)
        self.users.discard(seq.seq_id)
        self.failed.pop(seq.seq_id, None)


class LogitsProcessors(Feature):
    """The feature; ``options["logits_processors"]``: the classes (or "module.Class" names)."""

    def __init__(self, config, options: dict):
        super().__init__(config, options)
        self.classes = vllm_lp.load_logits_processors(options.get("logits_processors"))

    @classmethod
    def verify_params(cls, params) -> None:
        """The fields' types (the vocabulary is checked at admission)."""
        ids, words = params.allowed_token_ids, params.bad_words
        if ids is not None and not (isinstance(ids, (list, tuple))
                                    and all(type(t) is int and t >= 0 for t in ids)):
            raise ValueError("allowed_token_ids must be a list of non-negative ints, "
                             f"got {ids!r:.80}")
        if ids is not None and not ids:
            raise ValueError(f"allowed_token_ids is not None and empty! (None allows every "
                             f"token), got {ids!r}")
        if words is not None and not (isinstance(words, (list, tuple))
                                      and all(isinstance(w, str) for w in words)):
            raise TypeError(f"bad_words must be a list of strings, got {words!r:.80}")
        if words and not all(words):
            raise ValueError(f"bad_words cannot contain an empty string, got {words!r:.80}")

    def setup_engine(self, engine) -> None:
        self.hook = VllmLogitsProcessors(engine.config, engine.model_runner.device, self.classes)
        engine.core.hooks.append(self.hook)

    def check_request(self, params, engine) -> None:
        self.hook.verify(params, engine.tokenizer)
