"""Verify steps, a capability of the core: a decode step may carry tokens proposed to follow each
sequence's last one; one forward computes the logits of every position, and the sequence keeps a
run of the proposals and one token of its own. What proposes and what decides which tokens are kept
is a ``Drafter`` (a feature's); the core reserves the proposals' slots where blocks are free (a
proposal never preempts a sequence), builds the forward, books the kept tokens, gives back the
blocks that only rejected tokens used, and never hashes a token that was not kept.

A verify step's forward is a decode over more rows: sequence i's last token and its ``k_i``
proposals at positions ``n_i - 1 .. n_i - 1 + k_i`` are rows of their own, each attending to the
keys up to its position through the sequence's block table (every row's K/V is stored before any
row attends), so that it runs through the decode kernels and CUDA graphs as they are. A step whose
sequences have no proposal is a plain decode.

With async scheduling, decode steps overlap (step N+1 launched before step N is read back) while the
drafter has no proposal pending (``Drafter.pending``); once it has, the step in flight is read back
and the steps are synchronous (a proposal follows the last token, known) until it has none again."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.engine.batch import StepInput, block_tables
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.core import EngineCore
from nanovllm.engine.outputs import ModelRunnerOutput
from nanovllm.engine.overlap import OverlapEngineCore
from nanovllm.engine.sampling import SamplingInputs
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import logprobs_of


class Drafter:
    """Proposes tokens and decides which the model keeps; installed by ``VerifyEngineCore``."""

    num_lookahead_slots = 0  # the most tokens proposed for a sequence in one step

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Per sequence, up to ``limits[i]`` tokens to follow its known ones (their slots are
        reserved: a proposer may write K/V there)."""
        return [[] for _ in seqs]

    def verify(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[list[int]],
               sampling: SamplingInputs, generator: torch.Generator) -> torch.Tensor:
        """``logits`` [R, V]: sequence i's ``1 + len(drafts[i])`` rows, in batch order. Returns [R]
        int64: at each kept position its token (the accepted proposals, then the model's own token),
        -1 where the logits are not finite (nothing follows), -2 past the kept run."""
        raise NotImplementedError

    def pending(self, seqs: list[Sequence]) -> bool:
        """Whether a proposal may follow the tokens known now of any of ``seqs`` (checked after
        each read-back; while none may, decode steps overlap under async scheduling)."""
        return True

    def observe(self, seqs: list[Sequence], drafts: list[list[int]],
                num_accepted: list[int]) -> None:
        """Follows a verify step: per sequence its proposals and how many were accepted."""

    def forget(self, seq: Sequence) -> None:
        """``seq`` has ended."""

    def computed(self, seqs: list[Sequence], rows: list[int], positions: list[int],
                 counts: list[int]) -> None:
        """After every forward's read-back (``wants_computed``): sequence i's rows ``rows[i] ..``
        of the forward computed its positions ``positions[i] ..`` (``counts[i]`` of them), whose
        next tokens are known now (a verify step's kept run; ended sequences left out)."""

    wants_computed = False  # whether ``computed`` is called


def decode_rows(tables: np.ndarray, positions: np.ndarray, input_ids: np.ndarray,
                block_size: int) -> StepInput:
    """A decode-shaped input of one row per query: ``input_ids[r]`` at ``positions[r]`` with block
    table ``tables[r]``, attending to the keys up to its position (its own K/V stored first)."""
    return StepInput(
        is_prefill=False, input_ids=input_ids, positions=positions,
        slot_mapping=(tables[np.arange(len(positions)), positions // block_size] * block_size
                      + positions % block_size).astype(np.int32),
        block_tables=tables, context_lens=(positions + 1).astype(np.int32))


def prepare_verify(seqs: list[Sequence], drafts: list[list[int]], block_size: int) -> StepInput:
    """The verify forward's input, decode-shaped: a row per query (sequence i's last token, then
    its proposals), each with its sequence's block table and the keys up to its own position."""
    counts = np.array([1 + len(draft) for draft in drafts])
    seq_of, firsts = np.repeat(np.arange(len(seqs)), counts), np.cumsum(counts) - counts
    positions = (np.array([seq.num_tokens - 1 for seq in seqs])[seq_of] + np.arange(counts.sum())
                 - firsts[seq_of])
    tables = block_tables(seqs)[seq_of]
    input_ids = [t for seq, d in zip(seqs, drafts) for t in (seq.token_ids[-1], *d)]
    return decode_rows(tables, positions, np.array(input_ids, dtype=np.int64), block_size)


@dataclass
class VerifyOutput:
    """A launched verify step: the kept tokens per row on their way to the host."""
    output: ModelRunnerOutput
    drafts: list[list[int]]


class VerifyEngineCore(OverlapEngineCore):
    """The engine core with verify steps: synchronous while the drafter has a proposal pending (it
    follows the last token, known), overlapped (async scheduling) while it has none."""

    def __init__(self, config, resources, shutdown, hooks, drafter: Drafter):
        super().__init__(config, resources, shutdown, hooks)
        self.drafter = drafter
        self.proposing = True  # the drafter's ``pending`` after the last read-back
        self.num_decoded = 0  # the last step's kept tokens
        # over the engine's life (vLLM's spec_decode counters; the progress bar): sequence-steps
        # with proposals, proposals, those kept, and per position how often its proposal was kept
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * drafter.num_lookahead_slots

    @classmethod
    def replacing(cls, core: EngineCore, drafter: Drafter) -> VerifyEngineCore:
        """In place of ``core``, before any request: its resources and hooks (penalties aside)."""
        if core.requests or core.inflight is not None:
            raise RuntimeError("verify steps are installed before any request is admitted")
        return cls(core.config, core.resources, core._free, core.hooks[1:], drafter)

    def step(self) -> int:
        self.num_decoded = 0
        count = super().step()
        return -self.num_decoded if count < 0 else count

    def one_step(self) -> int:
        if self.config.async_scheduling and not self.proposing:
            count = self.overlap_step()
            if self.inflight is not None and isinstance(self.inflight[1], VerifyOutput):
                self.read_back()  # launched with every token known: the next step needs its own
            return count
        self.read_back()  # an overlapped step's
        return 0 if self.scheduler.is_finished() else self.normal_step()

    def launch(self, batch: SchedulerOutput):
        self.num_decoded = len(batch.seqs)
        if batch.is_prefill or self.inflight is not None:  # proposals follow known tokens only
            return super().launch(batch)
        runner, blocks = self.resources.runner, self.scheduler.block_manager
        limits = [self._reserve(seq) for seq in batch.seqs]
        drafts = [draft[:limit] for draft, limit
                  in zip(self.drafter.propose(batch.seqs, limits), limits)]
        for seq, draft in zip(batch.seqs, drafts):
            give_back_blocks(blocks, seq, seq.num_tokens + len(draft))
        sampling = None
        if any(drafts):
            try:
                sampling = runner.prepare_sample(batch)
            except Exception:  # the plain launch ends alone the sequences whose inputs fail
                self.drafter.observe(batch.seqs, drafts, [0] * len(drafts))  # none kept
                for seq in batch.seqs:
                    give_back_blocks(blocks, seq, seq.num_tokens)
        if sampling is None:
            return super().launch(batch)  # a plain decode (CUDA graphs)
        self.num_decoded = 0
        step = batch.step_input = prepare_verify(batch.seqs, drafts, self.config.kvcache_block_size)
        if self.resources.workers is not None:
            self.call_or_shut_down(self.resources.workers.call, "run", step)
        logits, _ = self.call_or_shut_down(runner.forward, step, sampling)
        with torch.inference_mode():
            token_ids = self.drafter.verify(batch.seqs, logits, drafts, sampling, runner.generator)
            rows = [k for k, d in zip(sampling.num_logprobs, drafts) for _ in range(1 + len(d))]
            most = max((k for k in rows if k is not None), default=None)
            logprobs = None if most is None else logprobs_of(
                torch.log_softmax(logits.float(), dim=-1), token_ids.clamp(min=0), most)
            return VerifyOutput(ModelRunnerOutput(token_ids, logprobs, rows), drafts)

    def _reserve(self, seq: Sequence) -> int:
        """Reserves slots for ``seq``'s proposals: as many as it may still generate past the
        model's own token, and free blocks hold; returns how many."""
        most = min(self.drafter.num_lookahead_slots,
                   seq.sampling_params.max_tokens - seq.num_completion_tokens - 1,
                   self.config.max_model_len - seq.num_tokens - 1)
        if most <= 0:
            return 0
        self.scheduler.block_manager.allocate_slot(seq, most)
        return min(most, len(seq.block_table) * self.config.kvcache_block_size - seq.num_tokens)

    def read_back(self, after_accept=None) -> None:
        if self.inflight is None:
            return
        batch, output = self.inflight
        if not isinstance(output, VerifyOutput):
            super().read_back(after_accept)
            self._look_ahead(batch.seqs)
            step = batch.step_input
            if self.drafter.wants_computed and step.is_prefill:
                cu_q = step.cu_seqlens_q.tolist()
                self._computed(batch.seqs, cu_q[:-1], step.positions[cu_q[:-1]].tolist(),
                               np.diff(cu_q).tolist())
            elif self.drafter.wants_computed:
                self._computed(batch.seqs, list(range(len(batch.seqs))),
                               step.positions.tolist(), [1] * len(batch.seqs))
            return
        (batch, verified), self.inflight = self.inflight, None
        token_ids, logprobs, _ = self.call_or_shut_down(verified.output.result)
        row, accepted, starts = 0, [], []
        for seq, draft in zip(batch.seqs, verified.drafts):
            starts.append(row)
            rows = range(row, row + 1 + len(draft))
            row += len(rows)
            kept = [r for r in rows if token_ids[r] != -2]
            accepted.append(max(0, len(kept) - 1))
            seq.num_scheduled_tokens = 0
            for r in kept:
                if seq.is_finished:
                    break
                self._keep(seq, token_ids[r], logprobs[r])
            if not seq.is_finished:
                give_back_blocks(self.scheduler.block_manager, seq, seq.num_tokens)
        self.drafter.observe(batch.seqs, verified.drafts, accepted)
        self._count(verified.drafts, accepted)
        self._look_ahead(batch.seqs)
        if self.drafter.wants_computed:
            self._computed(batch.seqs, starts, [seq.num_tokens - 2 - a for seq, a in
                                                zip(batch.seqs, accepted)],
                           [1 + a for a in accepted])

    def _look_ahead(self, seqs: list[Sequence]) -> None:
        """Whether the next decode proposes: asked only where decodes may overlap."""
        if self.config.async_scheduling:
            self.proposing = self.drafter.pending([seq for seq in seqs if not seq.is_finished])

    def _count(self, drafts: list[list[int]], accepted: list[int]) -> None:
        for draft, kept in zip(drafts, accepted):
            if draft:
                self.num_drafts += 1
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += kept
                self.accepted_per_pos += [0] * (kept - len(self.accepted_per_pos))
                for pos in range(kept):
                    self.accepted_per_pos[pos] += 1
        share = self.num_accepted_tokens / max(1, self.num_draft_tokens)
        self.progress["accepted"] = f"{share:.0%}"

    def _computed(self, seqs, rows, positions, counts) -> None:
        """``Drafter.computed`` of the sequences still running, before the next step."""
        alive = [i for i, seq in enumerate(seqs) if not seq.is_finished]
        self.drafter.computed(*([x[i] for i in alive] for x in (seqs, rows, positions, counts)))

    def _end(self, seq: Sequence, reason: str, stop_reason: int | str | None = None):
        super()._end(seq, reason, stop_reason)
        self.drafter.forget(seq)

    def _keep(self, seq: Sequence, token_id: int, logprob) -> None:
        """Books one kept token: its position's K/V is now known; stop checks as in a decode."""
        if token_id < 0:
            self.end_with_error(seq, FloatingPointError("the model's logits were not finite"))
            return
        seq.num_cached_tokens = seq.num_tokens  # the token before ``token_id`` was computed
        seq.token_ids.append(token_id)
        if logprob is not None:
            seq.logprobs.append(logprob)
        self.num_decoded += 1
        self.scheduler.block_manager.hash_blocks(seq)  # known tokens only: never a rejected one
        errors = {s: e for hook in self.hooks for s, e in hook.accept([(seq, token_id)]).items()}
        try:
            if seq in errors:
                raise errors[seq]
            stop = self.outputs.check_stop(self.requests[seq.seq_id], seq, token_id)
        except Exception as e:
            self.end_with_error(seq, e)
            return
        if stop is not None:
            self._end(seq, *stop)


def give_back_blocks(block_manager: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Frees ``seq``'s blocks past its first ``num_tokens`` tokens: reserved for proposals, they
    hold no kept token's K/V (never hashed, held by no other sequence)."""
    while len(seq.block_table) > -(-num_tokens // block_manager.block_size):
        block_id = seq.block_table.pop()
        block_manager.blocks[block_id].ref_count -= 1
        block_manager.used_block_ids.remove(block_id)
        block_manager.free_block_ids.append(block_id)
