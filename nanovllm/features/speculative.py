"""Speculative decoding, a feature (vLLM's ``LLM(speculative_config={...})``): proposers of tokens
for the core's verify steps, and the rejection sampler that keeps exactly the target model's tokens:
greedy, the proposals that its argmax agrees with; sampled, vLLM's rule (accept a proposal ``d``
with probability ``min(1, p(d) / q(d))``, else sample from ``(p - q)+`` normalised), so that the
outputs' distribution is the target's. Then the target's own token follows the kept run.

Proposers: ``ngram`` (the latest earlier occurrence of the sequence's last tokens, vLLM's
``prompt_lookup_min/max``), ``draft_model`` (a smaller model with the same vocabulary, run by this
engine in the target's KV-cache blocks: its attention layers are registered under the target, so
the runner sizes and allocates their cache beside the target's) and ``eagle3`` (EAGLE-3 heads,
``features/eagle3.py``, the same way). An n-gram proposal is a one-hot ``q``; a draft proposes its
argmax for a greedy request and draws from its own distribution (its ``q``) for a sampled one.
Penalties and the min_tokens ban apply row by row (``constrained_logits``).
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from nanovllm.config import load_hf_config
from nanovllm.demo import PREFIX, builtin_model_path
from nanovllm.engine.batch import StepInput, block_tables, prefill_rows
from nanovllm.engine.sampling import SamplingInputs
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.verify import Drafter, VerifyEngineCore, decode_rows
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampling_stages import apply_min_p, apply_penalties, apply_top_k_top_p
from nanovllm.models.presets import load_dummy_weights
from nanovllm.plugins import Feature, get_model_class
from nanovllm.sampling_params import check_int
from nanovllm.utils.context import set_context
from nanovllm.utils.loader import load_model

DRAFT_KEYS = {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size"}
KEYS = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
        "draft_model": DRAFT_KEYS, "eagle3": DRAFT_KEYS}
LATER = {"eagle": "EAGLE (1 and 2) heads"}


def parse_speculative_config(value) -> dict:
    """vLLM's ``speculative_config`` checked, its defaults filled in (n-gram lookup: 5 and 5)."""
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
    config = dict(value)
    method = config.get("method") or ("draft_model" if config.get("model") else None)
    if method in LATER:
        raise ValueError(f"speculative_config method={method!r} ({LATER[method]}) is not "
                         f"supported yet; supported: {sorted(KEYS)}")
    if method not in KEYS:
        raise ValueError(f"speculative_config method must be one of {sorted(KEYS)} (or a 'model' "
                         f"for 'draft_model'), got {config.get('method')!r}")
    if unknown := sorted(set(config) - KEYS[method]):
        raise ValueError(f"speculative_config has keys {unknown} that method {method!r} does not "
                         f"take; it takes {sorted(KEYS[method])}")
    if "num_speculative_tokens" not in config:
        raise ValueError("speculative_config needs num_speculative_tokens")
    check_int("num_speculative_tokens", config["num_speculative_tokens"], lo=1, hi=64)
    if method in ("draft_model", "eagle3"):
        if config.get("draft_tensor_parallel_size") not in (None, 1):
            raise ValueError("speculative_config draft_tensor_parallel_size must be 1 (the draft "
                             f"runs on rank 0), got {config['draft_tensor_parallel_size']!r}")
        if not isinstance(config.get("model"), (str, os.PathLike)):
            raise TypeError(f"speculative_config model must be a directory, got "
                            f"{config.get('model')!r}")
        model = os.fspath(config["model"])
        path = builtin_model_path(model) if model.startswith(PREFIX) else model
        if not os.path.isdir(path):
            raise ValueError(f"speculative_config model {model!r} is not a directory")
        return dict(config, method=method, model=path)
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if config.get(name) is not None:
            check_int(name, config[name], lo=1)
    low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = 5
    low, high = high if low is None else low, low if high is None else high
    if low > high:
        raise ValueError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
    return dict(config, method="ngram", prompt_lookup_min=low, prompt_lookup_max=high)


def ngram_propose(tokens: np.ndarray, low: int, high: int, k: int) -> list[int]:
    """The ``k`` tokens after the latest earlier occurrence of the longest suffix of ``tokens`` of
    ``low`` to ``high`` tokens (fewer at the end; none without an occurrence)."""
    last = len(tokens) - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # occurrences of the last token
    for n in range(min(high, last), low - 1, -1):
        match = ends[ends >= n - 1]
        for back in range(1, n):
            match = match[tokens[match - back] == tokens[last - back]]
        if match.size:
            return tokens[match[-1] + 1:match[-1] + 1 + k].tolist()
    return []


def proposal_rows(drafts: list[list[int]], device) -> tuple[torch.Tensor, ...]:
    """A verify step's rows (each sequence's proposals, then its own token's row): the rows per
    sequence (on the host), each row's sequence, each row's proposal (-1 on an own token's row)."""
    counts = torch.tensor([1 + len(d) for d in drafts])
    seq_of = torch.repeat_interleave(torch.arange(len(drafts)), counts).to(device)
    return counts, seq_of, torch.tensor([t for d in drafts for t in (*d, -1)], device=device)


def kept_run(accepted: torch.Tensor, proposed: torch.Tensor, seq_of: torch.Tensor,
             num_seqs: int, own, bad: torch.Tensor) -> torch.Tensor:
    """[R]: each sequence's proposals up to its first row not ``accepted``, there its own token
    (``own(first_stop)``, -1 where the logits are not finite), -2 past it."""
    rows = torch.arange(len(proposed), device=proposed.device)
    first_stop = torch.full((num_seqs,), len(rows), device=rows.device).scatter_reduce(
        0, seq_of, torch.where(accepted, len(rows), rows), "amin")
    at = first_stop[seq_of] == rows
    tokens = torch.where(rows < first_stop[seq_of], proposed, -2)
    tokens[at] = own(first_stop)
    return tokens.masked_fill(at & bad, -1)


def not_finite(logits: torch.Tensor) -> torch.Tensor:
    """Rows with a NaN or +inf logit (the sampler's rule: no token)."""
    return (top := logits.amax(-1)).isnan() | top.isposinf()


def greedy_verify(logits: torch.Tensor, drafts: list[list[int]]) -> torch.Tensor:
    """``rejection_sample`` of a batch without sampled rows: the proposals that the argmax agrees
    with, then the argmax. The run is found on the host from one read of the argmax (a verify
    step is read back next anyway): a few kernels where the device-side rule takes a score."""
    best = torch.where(not_finite(logits), -1, logits.argmax(-1)).tolist()  # -1: never a proposal
    tokens, row = [], 0
    for draft in drafts:
        run = 0
        while run < len(draft) and best[row + run] == draft[run]:
            run += 1
        tokens += [*draft[:run], best[row + run]] + [-2] * (len(draft) - run)
        row += 1 + len(draft)
    return torch.tensor(tokens).to(logits.device)


def sampling_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_k=None, top_p=None,
                   min_p=None) -> torch.Tensor:
    """[R, V] float32: what the sampler draws from (temperature, then top-k/top-p, then min-p), per
    row; a greedy row (temperature 0) as at temperature 1."""
    scaled = logits.float() / torch.where(temperatures > 0, temperatures, 1.0)[:, None]
    if top_k is not None or top_p is not None:
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    return torch.softmax(scaled, dim=-1)


def rejection_sample(logits: torch.Tensor, drafts: list[list[int]], sampling: SamplingInputs,
                     generator: torch.Generator,
                     draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """``Drafter.verify``: [R] kept tokens, -1 (not finite), -2 (not kept). ``draft_probs`` [R, V]:
    the distribution each proposal was drawn from (a sequence's rows, then a row for its own
    token); None: one-hot proposals."""
    device, b = logits.device, sampling.batch
    counts, seq_of, proposed = proposal_rows(drafts, device)
    num_rows, num_seqs = len(proposed), len(drafts)
    logits = logits.float()
    bad = not_finite(logits)
    temperatures = b.temperatures[seq_of]
    probs = sampling_probs(logits, temperatures, *(None if x is None else x[seq_of]
                                                   for x in (b.top_k, b.top_p, b.min_p)))
    uniform = torch.rand(num_rows, device=device, generator=generator)
    noise = torch.empty(num_seqs, logits.size(1), device=device).exponential_(generator=generator)
    starts = (torch.cumsum(counts, 0) - counts).tolist()
    for i, g in enumerate(b.generators or ()):  # seeded: their own draws, whatever the batch;
        if g is not None:  # without proposals the sampler's (one exponential a token)
            num = len(drafts[i])
            uniform[starts[i]:starts[i] + num] = torch.rand(num, device=device, generator=g)
            noise[i].exponential_(generator=g)
    draft = proposed.clamp(min=0)
    p_draft = probs.gather(1, draft[:, None]).squeeze(1)
    q_draft = 1.0 if draft_probs is None else draft_probs.gather(1, draft[:, None]).squeeze(1)
    accepted = torch.where(temperatures > 0, uniform * q_draft < p_draft,
                           logits.argmax(-1) == draft)
    accepted &= (proposed >= 0) & ~bad

    def own(first_stop):  # after a rejected proposal from (p - q)+ normalised, else from p
        residual = probs[first_stop]
        rejected = proposed[first_stop] >= 0
        if draft_probs is None:
            residual[rejected, draft[first_stop][rejected]] = 0
        else:
            residual[rejected] = (residual[rejected]
                                  - draft_probs[first_stop][rejected]).clamp_min(0)
        residual /= residual.sum(-1, keepdim=True).clamp_min(1e-30)
        sampled = (residual / noise.clamp_min(1e-20)).argmax(-1)
        return torch.where(b.temperatures > 0, sampled, logits[first_stop].argmax(-1))

    return kept_run(accepted, proposed, seq_of, num_seqs, own, bad)


def draw_tokens(logits: torch.Tensor, seqs: list[Sequence], runner
                ) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft's token after each row (one a sequence): its argmax for a greedy request, else drawn
    from its distribution under the request's sampling parameters (the request's own generator
    when seeded), which is returned too (the rejection rule's q)."""
    tokens, probs = logits.argmax(-1), [None] * len(seqs)
    sampled = [i for i, seq in enumerate(seqs) if not seq.sampling_params.is_greedy]
    if sampled:
        params = [seqs[i].sampling_params for i in sampled]
        device, vocab = logits.device, logits.size(1)
        values = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
        q = sampling_probs(
            logits[sampled], values([sp.temperature for sp in params]),
            values([sp.top_k if sp.top_k > 0 else vocab for sp in params]),
            values([sp.top_p for sp in params]), values([sp.min_p for sp in params]))
        for row, i in enumerate(sampled):
            g = runner.sampling.generators.get(seqs[i].seq_id, runner.generator)
            noise = torch.empty(vocab, device=device).exponential_(generator=g)
            tokens[i] = (q[row] / noise.clamp_min(1e-20)).argmax()
            probs[i] = q[row]
    return tokens.tolist(), probs


def constrained_logits(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                       b) -> torch.Tensor:
    """The logits past the sampler's penalties and min_tokens ban, row by row: a row's generated
    tokens are its sequence's and the proposals before the row (what they are if kept)."""
    if b.presence_penalty is None and b.banned_ids is None:
        return logits
    device, vocab = logits.device, logits.size(1)
    _, seq_of, _ = proposal_rows(drafts, device)
    logits = logits.float()
    if b.presence_penalty is not None:
        before = [d[:j] for d in drafts for j in range(len(d) + 1)]
        width = max(1, max(map(len, before)))
        extra = torch.tensor([r + [vocab] * (width - len(r)) for r in before], device=device)
        rows = SimpleNamespace(output_ids=torch.cat([b.output_ids[seq_of], extra], 1),
                               **{name: getattr(b, name)[seq_of] for name in (
                                   "prompt_ids", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty")})
        logits = apply_penalties(logits, rows)
    if b.banned_ids is not None:  # a row whose count of generated tokens is under min_tokens
        under = torch.tensor([seq.num_completion_tokens + j < seq.sampling_params.min_tokens
                              for seq, d in zip(seqs, drafts) for j in range(len(d) + 1)],
                             device=device)
        mask = torch.zeros_like(logits, dtype=torch.bool)
        mask[:, b.banned_ids] = b.banned_rows[seq_of] & under[:, None]
        logits = logits.masked_fill(mask, float("-inf"))  # not in place: logprobs are raw
    return logits


def verify_proposals(seqs, logits, drafts, sampling, generator, probs: dict | None = None
                     ) -> torch.Tensor:
    """``Drafter.verify``: the penalties and min_tokens ban row by row, then greedy rows' argmax
    or the rejection rule (``probs``: the q rows a drafter kept, seq_id -> one a proposal; none:
    one-hot proposals)."""
    logits = constrained_logits(logits, seqs, drafts, sampling.batch)
    if not probs:
        if all(seq.sampling_params.is_greedy for seq in seqs):
            return greedy_verify(logits, drafts)
        return rejection_sample(logits, drafts, sampling, generator)
    zero = logits.new_zeros(logits.size(1), dtype=torch.float32)
    rows = [row for seq, draft in zip(seqs, drafts)
            for row in (*probs.get(seq.seq_id, [zero] * len(draft))[:len(draft)], zero)]
    return rejection_sample(logits, drafts, sampling, generator, torch.stack(rows))


def extend_proposals(seqs: list[Sequence], drafts: list[list[int]], active: list[int],
                     limits: list[int], offset: int, block_size: int, run) -> None:
    """Each proposal past the first, one forward a position: for j = 1, 2, .. the sequences of
    ``active`` whose limit is over j run position ``num_tokens + offset + j`` reading their last
    proposal; ``run(step, rows)`` gives each of those rows its next token."""
    for j in range(1, max(limits, default=0)):
        active = [i for i in active if limits[i] > j]
        if not active:
            return
        positions = np.array([seqs[i].num_tokens + offset + j for i in active], dtype=np.int64)
        step = decode_rows(block_tables([seqs[i] for i in active]), positions,
                           np.array([drafts[i][-1] for i in active], dtype=np.int64), block_size)
        for i, token in zip(active, run(step, active)):
            drafts[i].append(token)


class Proposer(Drafter):
    """Every proposer's verify: the penalties row by row, then the rejection sampler."""

    def __init__(self, num_speculative_tokens: int):
        self.num_lookahead_slots = num_speculative_tokens

    def verify(self, seqs, logits, drafts, sampling, generator) -> torch.Tensor:
        return verify_proposals(seqs, logits, drafts, sampling, generator)


def spec_decode_metrics(core: VerifyEngineCore, labels: dict) -> list:
    """vLLM's ``vllm:spec_decode_*`` metrics of the verify core's counters (the types of
    ``nanovllm.v1.metrics.reader``)."""
    from nanovllm.features.metrics import Counter, Vector
    counters = [Counter(f"vllm:spec_decode_{name}", dict(labels), getattr(core, name))
                for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")]
    return counters + [Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                              list(core.accepted_per_pos))]


class NgramDrafter(Proposer):
    """n-gram lookup in the sequence's own tokens (prompt and output)."""

    def __init__(self, config: dict):
        super().__init__(config["num_speculative_tokens"])
        self.low, self.high = config["prompt_lookup_min"], config["prompt_lookup_max"]
        self.arrays: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (its tokens, how many)

    def tokens(self, seq: Sequence) -> np.ndarray:
        """``seq``'s tokens as an array, kept between steps (a step copies only the new ones)."""
        array, known = self.arrays.get(seq.seq_id, (np.empty(0, dtype=np.int64), 0))
        n = len(seq.token_ids)
        if n > len(array):
            array = np.concatenate([array[:known], np.empty(max(n, 2 * len(array)) - known,
                                                            dtype=np.int64)])
        array[known:n] = seq.token_ids[known:n]
        self.arrays[seq.seq_id] = (array, n)
        return array[:n]

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [ngram_propose(self.tokens(seq), self.low, self.high, limit) if limit else []
                for seq, limit in zip(seqs, limits)]

    def pending(self, seqs: list[Sequence]) -> bool:
        return any(ngram_propose(self.tokens(seq), self.low, self.high, 1) for seq in seqs)

    def forget(self, seq: Sequence) -> None:
        self.arrays.pop(seq.seq_id, None)


class DraftModelDrafter(Proposer):
    """A draft model's continuation: its argmax for a greedy request, else drawn from its
    distribution under the request's temperature, top-k, top-p and min-p (the ``q`` of the
    rejection rule; a seeded request draws from its own generator). Its K/V lives in the target's
    blocks (its own layers of the cache): a sequence's first ``done`` positions are computed there,
    in the blocks recorded with them (a preempted sequence's new blocks start it over). A step
    first computes the positions since then (the kept tokens: one or two), then one position per
    proposal."""

    def __init__(self, config: dict, runner, draft: nn.Module):
        super().__init__(config["num_speculative_tokens"])
        self.runner, self.draft = runner, draft
        self.block_size = runner.block_size
        self.budget = runner.config.max_num_batched_tokens
        self.done: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (positions, their blocks)
        self.proposed_at: dict[int, int] = {}  # seq_id -> num_tokens when it last proposed
        self.probs: dict[int, list[torch.Tensor]] = {}  # the last proposals' q rows (sampled)

    def _start(self, seq: Sequence) -> int:
        done, blocks = self.done.get(seq.seq_id, (0, []))
        return min(done, seq.num_tokens - 1) if seq.block_table[:len(blocks)] == blocks else 0

    @torch.inference_mode()
    def _draw(self, step: StepInput, seqs: list[Sequence]) -> list[int]:
        """The draft's next token after each row of ``step`` (one a sequence of ``seqs``)."""
        input_ids, positions, context = self.runner.step_tensors(step)
        with set_context(step.is_prefill, **context):
            logits = self.draft.compute_logits(self.draft(input_ids, positions))
        tokens, probs = draw_tokens(logits, seqs, self.runner)
        for seq, q in zip(seqs, probs):
            if q is not None:
                self.probs.setdefault(seq.seq_id, []).append(q)
        return tokens

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts = [[] for _ in seqs]
        rows = [i for i, limit in enumerate(limits) if limit]
        self.probs.clear()
        group, tokens = [], 0
        for i in rows + [None]:  # the catch-up, in forwards of at most the token budget
            count = 0 if i is None else seqs[i].num_tokens - self._start(seqs[i])
            if group and (i is None or tokens + count > self.budget):
                chosen = [seqs[j] for j in group]
                starts = [self._start(s) for s in chosen]
                counts = [s.num_tokens - start for s, start in zip(chosen, starts)]
                firsts = self._draw(prefill_rows(chosen, starts, counts, self.block_size),
                                    chosen)
                for j, token in zip(group, firsts):
                    drafts[j].append(token)
                group, tokens = [], 0
            if i is not None:
                group.append(i)
                tokens += count
        extend_proposals(seqs, drafts, rows, limits, -1, self.block_size,
                         lambda step, active: self._draw(step, [seqs[i] for i in active]))
        for i in rows:
            seq = seqs[i]
            done = seq.num_tokens - 1 + len(drafts[i])  # the last proposal's K/V is not computed
            self.done[seq.seq_id] = (done, list(seq.block_table[:-(-done // self.block_size)]))
            self.proposed_at[seq.seq_id] = seq.num_tokens
        return drafts

    def verify(self, seqs, logits, drafts, sampling, generator) -> torch.Tensor:
        return verify_proposals(seqs, logits, drafts, sampling, generator, self.probs)

    def observe(self, seqs, drafts, num_accepted) -> None:
        for seq, draft, accepted in zip(seqs, drafts, num_accepted):
            if draft and seq.seq_id in self.done:  # positions of rejected proposals are stale
                done, blocks = self.done[seq.seq_id]
                done = min(done, self.proposed_at[seq.seq_id] + accepted)
                self.done[seq.seq_id] = (done, blocks[:-(-done // self.block_size)])

    def forget(self, seq: Sequence) -> None:
        self.done.pop(seq.seq_id, None)
        self.proposed_at.pop(seq.seq_id, None)


class Eagle3Drafter(Proposer):
    """EAGLE-3 heads (``features/eagle3.py``): after each target forward the head runs over the
    positions just computed (the target's states entering three of its layers, copied by hooks),
    which gives each sequence's first proposal; the others come from the head's own states at the
    next step, one position each."""

    wants_computed = True

    def __init__(self, config: dict, runner, head: nn.Module, aux):
        super().__init__(config["num_speculative_tokens"])
        self.runner, self.head, self.aux = runner, head, aux
        self.block_size = runner.block_size
        self.first: dict[int, tuple] = {}  # seq_id -> (next position, token, state, q or None)
        self.probs: dict[int, list[torch.Tensor]] = {}  # the proposals' q rows (sampled)

    @torch.inference_mode()
    def _run(self, step: StepInput, states: torch.Tensor, seqs: list[Sequence]):
        input_ids, positions, context = self.runner.step_tensors(step)
        with set_context(step.is_prefill, **context):
            prenorm = self.head(input_ids, positions, states)
            logits = self.head.logits(prenorm)
        last = context["logits_indices"] if step.is_prefill else slice(None)
        return (*draw_tokens(logits, seqs, self.runner), prenorm[last])

    def computed(self, seqs, rows, positions, counts) -> None:
        if not seqs:
            return
        buffer = self.aux.buffer
        if max(r + c for r, c in zip(rows, counts)) > buffer.size(0):  # rows the hooks did not
            return  # keep: no proposal
        index = torch.tensor([r + j for r, c in zip(rows, counts) for j in range(c)],
                             device=buffer.device)
        step = prefill_rows(seqs, positions, counts, self.block_size, shift=1)
        with torch.inference_mode():
            states = self.head.fc(self.aux.rows(index).to(self.head.fc.weight.dtype))
        tokens, probs, prenorm = self._run(step, states, seqs)
        for seq, p, c, token, q, state in zip(seqs, positions, counts, tokens, probs, prenorm):
            self.first[seq.seq_id] = (p + c, token, state, q)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts, states, active = [[] for _ in seqs], {}, []
        self.probs.clear()
        for i, (seq, limit) in enumerate(zip(seqs, limits)):
            first = self.first.get(seq.seq_id)
            if limit and first is not None and first[0] == seq.num_tokens - 1:
                drafts[i].append(first[1])
                states[i] = first[2]
                if first[3] is not None:
                    self.probs[seq.seq_id] = [first[3]]
                active.append(i)

        def run(step: StepInput, active: list[int]) -> list[int]:  # the head's own states
            tokens, probs, prenorm = self._run(step, torch.stack([states[i] for i in active]),
                                               [seqs[i] for i in active])
            for i, q, state in zip(active, probs, prenorm):
                states[i] = state
                if q is not None:
                    self.probs.setdefault(seqs[i].seq_id, []).append(q)
            return tokens
        extend_proposals(seqs, drafts, active, limits, -2, self.block_size, run)
        return drafts

    def verify(self, seqs, logits, drafts, sampling, generator) -> torch.Tensor:
        return verify_proposals(seqs, logits, drafts, sampling, generator, self.probs)

    def forget(self, seq: Sequence) -> None:
        self.first.pop(seq.seq_id, None)


def check_shares_target(path: str, hf, head_dim: int, config, runner) -> None:
    """Refuses by name a draft or head (config ``hf``) without the target's vocabulary or KV-cache
    layout (its layers' cache lives in the target's blocks)."""
    target = config.hf_config
    if hf.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model {path!r} has vocab_size {hf.vocab_size}, the "
                         f"target {target.vocab_size}: a draft needs the target's vocabulary")
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if (kv_heads, head_dim) != (runner.num_kv_heads, runner.head_dim):
        raise ValueError(f"speculative_config model {path!r} has {kv_heads} KV heads of "
                         f"{head_dim}, the target {runner.num_kv_heads} of {runner.head_dim}: "
                         "the draft's cache shares the target's layout")


def build_draft(config, runner, path: str) -> nn.Module:
    """The draft model on the runner's device, its weights loaded (random with dummy weights);
    refused by name when it cannot share the target's tokens and KV-cache layout."""
    hf = load_hf_config(path)
    cls = get_model_class(hf)
    check_shares_target(path, hf, cls.head_dim(hf), config, runner)
    cls.check_config(hf, config.max_model_len)
    draft = cls(hf, max_model_len=config.max_model_len)
    if config.load_format == "dummy":
        load_dummy_weights(draft, config.seed + 1)
    else:
        load_model(draft, path)
    return draft


class SpeculativeDecoding(Feature):
    """The feature; ``options["speculative_config"]``: vLLM's dict, checked."""

    def __init__(self, config, options: dict):
        super().__init__(config, options)
        self.speculative_config = spec = parse_speculative_config(options["speculative_config"])
        if config.async_scheduling and config.tensor_parallel_size > 1:
            raise ValueError("async_scheduling=True with speculative_config needs "
                             "tensor_parallel_size=1 (a verify step does not broadcast its tokens "
                             "to the other ranks)")
        if spec["method"] != "ngram" and config.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config method {spec['method']!r} needs "
                             "tensor_parallel_size=1 (the draft runs unsharded on rank 0, its "
                             "cache in the target's)")
        self.drafter = NgramDrafter(spec) if spec["method"] == "ngram" else None

    def setup_runner(self, runner) -> None:
        if self.drafter is None:  # the draft's layers join the target's before its KV cache
            runner.after_build.append(lambda model: self._attach_draft(runner, model))

    def _attach_draft(self, runner, model: nn.Module) -> None:
        spec, config = self.speculative_config, self.config
        if spec["method"] == "eagle3":
            from nanovllm.features.eagle3 import AuxStates, build_eagle3, eagle3_config
            from nanovllm.models.llama import head_dim_of
            hf = eagle3_config(spec["model"])
            check_shares_target(spec["model"], hf, head_dim_of(hf), config, runner)
            draft, layers = build_eagle3(config, model, spec["model"], hf)
            rows = max(config.max_num_batched_tokens,
                       config.max_num_seqs * (1 + spec["num_speculative_tokens"]))
            aux = AuxStates(model, layers, rows, config.hf_config.hidden_size)
            self.drafter = Eagle3Drafter(spec, runner, draft, aux)
        else:
            draft = build_draft(config, runner, spec["model"])
            self.drafter = DraftModelDrafter(spec, runner, draft)
        layers = [m for m in draft.modules() if isinstance(m, Attention)]
        model.add_module("draft_attention", nn.ModuleList(layers))  # no parameters: not loaded
        runner.extensions["speculative"] = self  # close(): lets go of the draft at exit

    def close(self) -> None:
        for name in ("draft", "head", "aux"):
            if hasattr(self.drafter, name):
                setattr(self.drafter, name, None)

    def setup_engine(self, engine) -> None:
        engine.core = VerifyEngineCore.replacing(engine.core, self.drafter)

    def check_request(self, params, engine) -> None:
        refused = [name for name, on in (
            ("structured_outputs", params.structured_outputs is not None),
            ("allowed_token_ids", params.allowed_token_ids is not None),
            ("bad_words", bool(params.bad_words))) if on]
        if refused or "logits_processors" in engine.features:
            what = refused[0] if refused else "the engine's logits_processors"
            raise ValueError(f"{what} is not supported with speculative_config (the verify step "
                             "samples each proposed position without them)")
