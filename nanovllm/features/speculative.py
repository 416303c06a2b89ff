"""Speculative decoding, a feature (vLLM's ``LLM(speculative_config={...})``): tokens proposed by
n-gram lookup in the sequence's own tokens, verified by the core's verify steps, and the rejection
sampler that keeps exactly the target model's tokens: greedy, the proposals that its argmax agrees
with; sampled, vLLM's rule (accept a proposal ``d`` with probability ``min(1, p(d) / q(d))``, else
sample from ``(p - q)+`` normalised; an n-gram proposal is a one-hot ``q``), so that the outputs'
distribution is the target's. Then the target's own token follows the kept run."""
from __future__ import annotations

import numpy as np
import torch

from nanovllm.engine.sampling import SamplingInputs
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.verify import Drafter, VerifyEngineCore
from nanovllm.layers.sampling_stages import apply_min_p, apply_top_k_top_p
from nanovllm.plugins import Feature
from nanovllm.sampling_params import check_int

NGRAM_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
LATER = {"draft_model": "a draft model", "eagle3": "EAGLE-3 heads", "eagle": "EAGLE heads"}


def parse_speculative_config(value) -> dict:
    """vLLM's ``speculative_config`` checked, its defaults filled in (n-gram lookup: 5 and 5)."""
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
    config = dict(value)
    method = config.get("method") or ("draft_model" if config.get("model") else None)
    if method in LATER:
        raise ValueError(f"speculative_config method={method!r} ({LATER[method]}) is not "
                         "supported yet; supported: 'ngram'")
    if method != "ngram":
        raise ValueError(f"speculative_config needs method='ngram' (the one supported), got "
                         f"{config.get('method')!r}")
    if unknown := sorted(set(config) - NGRAM_KEYS):
        raise ValueError(f"speculative_config has keys {unknown} that method 'ngram' does not "
                         f"take; it takes {sorted(NGRAM_KEYS)}")
    if "num_speculative_tokens" not in config:
        raise ValueError("speculative_config needs num_speculative_tokens")
    check_int("num_speculative_tokens", config["num_speculative_tokens"], lo=1, hi=64)
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


def rejection_sample(logits: torch.Tensor, drafts: list[list[int]], sampling: SamplingInputs,
                     generator: torch.Generator) -> torch.Tensor:
    """``Drafter.verify`` for one-hot proposals: [R] kept tokens, -1 (not finite), -2 (not kept)."""
    device, b = logits.device, sampling.batch
    counts = torch.tensor([1 + len(d) for d in drafts])
    num_rows, num_seqs = int(counts.sum()), len(drafts)
    seq_of = torch.repeat_interleave(torch.arange(num_seqs), counts).to(device)
    proposed = torch.tensor([t for d in drafts for t in (*d, -1)], device=device)
    logits = logits.float()
    bad = (top := logits.amax(-1)).isnan() | top.isposinf()
    temperatures = b.temperatures[seq_of]
    scaled = logits / torch.where(temperatures > 0, temperatures, 1.0)[:, None]
    if b.top_k is not None or b.top_p is not None:
        scaled = apply_top_k_top_p(scaled, None if b.top_k is None else b.top_k[seq_of],
                                   None if b.top_p is None else b.top_p[seq_of])
    if b.min_p is not None:
        scaled = apply_min_p(scaled, b.min_p[seq_of])
    probs = torch.softmax(scaled, dim=-1)
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
    accepted = torch.where(temperatures > 0, uniform < p_draft, logits.argmax(-1) == draft)
    accepted &= (proposed >= 0) & ~bad
    rows = torch.arange(num_rows, device=device)
    first_stop = torch.full((num_seqs,), num_rows, device=device).scatter_reduce(
        0, seq_of, torch.where(accepted, num_rows, rows), "amin")  # the row of the own token
    at = first_stop[seq_of] == rows
    residual = probs[first_stop]  # rejected proposal: (p - one-hot)+ normalised; else p
    rejected = proposed[first_stop] >= 0
    residual[rejected, draft[first_stop][rejected]] = 0
    residual /= residual.sum(-1, keepdim=True).clamp_min(1e-30)
    sampled = (residual / noise.clamp_min(1e-20)).argmax(-1)
    own = torch.where(b.temperatures > 0, sampled, logits[first_stop].argmax(-1))
    tokens = torch.where(rows < first_stop[seq_of], proposed, -2)
    tokens[at] = own
    return tokens.masked_fill(at & bad, -1)


class NgramDrafter(Drafter):
    """n-gram lookup proposals, the rejection sampler, vLLM's ``spec_decode`` counters."""

    def __init__(self, config: dict):
        self.num_lookahead_slots = config["num_speculative_tokens"]
        self.low, self.high = config["prompt_lookup_min"], config["prompt_lookup_max"]
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.num_lookahead_slots

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        return [ngram_propose(np.asarray(seq.token_ids), self.low, self.high,
                              self.num_lookahead_slots) for seq in seqs]

    def verify(self, logits, drafts, sampling, generator) -> torch.Tensor:
        return rejection_sample(logits, drafts, sampling, generator)

    def observe(self, drafts: list[list[int]], num_accepted: list[int]) -> None:
        for draft, accepted in zip(drafts, num_accepted):
            if draft:
                self.num_drafts += 1
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += accepted
                for pos in range(accepted):
                    self.accepted_per_pos[pos] += 1

    def metrics(self, labels: dict) -> list:
        """vLLM's ``vllm:spec_decode_*`` metrics (the types of ``nanovllm.v1.metrics.reader``)."""
        from nanovllm.features.metrics import Counter, Vector
        counters = [Counter(f"vllm:spec_decode_{name}", dict(labels), getattr(self, name))
                    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")]
        return counters + [Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                                  list(self.accepted_per_pos))]


class SpeculativeDecoding(Feature):
    """The feature; ``options["speculative_config"]``: vLLM's dict, checked."""

    def __init__(self, config, options: dict):
        super().__init__(config, options)
        self.speculative_config = parse_speculative_config(options["speculative_config"])
        if config.async_scheduling:
            raise ValueError("speculative_config needs async_scheduling=False (a proposal needs "
                             "the step before it read back)")
        self.drafter = NgramDrafter(self.speculative_config)

    def setup_engine(self, engine) -> None:
        engine.core = VerifyEngineCore.replacing(engine.core, self.drafter)

    def check_request(self, params, engine) -> None:
        refused = [name for name, on in (
            ("presence_penalty/frequency_penalty/repetition_penalty", params.needs_penalties),
            ("min_tokens", params.min_tokens > 0),
            ("structured_outputs", params.structured_outputs is not None),
            ("allowed_token_ids", params.allowed_token_ids is not None),
            ("bad_words", bool(params.bad_words))) if on]
        if refused or "logits_processors" in engine.features:
            what = refused[0] if refused else "the engine's logits_processors"
            raise ValueError(f"{what} is not supported with speculative_config (the verify step "
                             "samples each proposed position without them)")
