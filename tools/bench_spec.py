"""Speculative decoding measured (issue 47): what a verify step costs at a given acceptance, and the
acceptance that real weights give.

Two modes, one JSON line a point, then a table:

- ``--oracle`` (speed against acceptance, any model, e.g. the presets' random weights on the GPU):
  a plain greedy run gives each request's continuation; then a benchmark-only proposer (here, not
  in the package) proposes ``k`` tokens a step of which the first ``m - 1`` are that continuation
  and the rest wrong, so that every verify step keeps ``m`` tokens (the target's own included);
  ``--accept 1.5`` alternates 1 and 2. Also the n-gram proposer on the same prompts (random tokens:
  few matches, its proposals rejected; with async scheduling the decodes with no proposal pending
  overlap: the cost of looking and verifying for nothing), "rejected" (4
  wrong proposals every step: a verify step's cost at zero acceptance) and "none" (the verify
  engine without proposals: the synchronous loop's cost against the plain engine's async one).
- ``--heldout`` (acceptance on real weights): the demo model continues each held-out file of its
  training (the first ``--prompt-len`` tokens as the prompt), greedily, with n-gram lookup and
  without: the mean tokens a decode step keeps, and the speed-up on this machine.

    python tools/bench_spec.py --oracle --model qwen3-0.6b --batch 1 4 16 64 --accept 1 2 3 4
    python tools/bench_spec.py --heldout --draft nanovllm:demo-draft  # the demo model, this machine
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import sys
import time
from random import Random

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.features.speculative import NgramDrafter, Proposer  # noqa: E402
from nanovllm.models.presets import PRESETS  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


class OracleDrafter(Proposer):
    """Proposes ``k`` tokens: the first ``m - 1`` from the request's plain continuation, the rest
    off by one (rejected); ``m`` cycles through ``accepted`` (e.g. [1, 2] for a mean of 1.5).

    The verify step runs the engine's sampler (its cost), then keeps the first ``m - 1`` proposals
    and the target's argmax after them whatever it decided: random weights give near-flat logits,
    where a forward of other shapes (a verify step's rows) flips near-ties, so that the plain
    continuation stops being the target's after the first flip and the set acceptance would not
    hold (measured on an H100, 2026-12-05: 1.02 tokens a step for a set 3 at 8B). With real weights
    the two agree (``same_as_plain``)."""

    def __init__(self, references: dict[tuple, list[int]], k: int, accepted: list[int],
                 vocab_size: int):
        super().__init__(k)
        self.references, self.cycle, self.vocab_size = references, accepted, vocab_size
        self.calls, self.keep = 0, {}

    def propose(self, seqs, limits):
        drafts = []
        for seq, limit in zip(seqs, limits):
            m = self.cycle[self.calls % len(self.cycle)]
            self.calls += 1
            ref = self.references.get(tuple(seq.token_ids[:seq.num_prompt_tokens]))
            done = seq.num_completion_tokens
            if ref is None:  # the warmup's: k rows to verify as the timed run's
                ref, m = seq.token_ids[:done + limit], 1
            draft = list(ref[done:done + limit])
            for i in range(m - 1, len(draft)):
                draft[i] = (draft[i] + 1) % self.vocab_size
            drafts.append(draft)
            self.keep[seq.seq_id] = min(m - 1, len(draft))
        return drafts

    def verify(self, seqs, logits, drafts, sampling, generator):
        decided = super().verify(seqs, logits, drafts, sampling, generator)
        plan = []  # -3: the target's argmax
        for seq, draft in zip(seqs, drafts):
            kept = self.keep.pop(seq.seq_id)
            plan += [*draft[:kept], -3] + [-2] * (len(draft) - kept)
        plan = torch.tensor(plan, device=decided.device)
        return torch.where(plan == -3, logits.argmax(dim=-1), plan)


def accept_cycle(mean: float) -> list[int]:
    """Integers whose mean is ``mean`` (to a tenth), e.g. 2.5 -> [2, 3]."""
    low = int(mean)
    tenths = round((mean - low) * 10)
    return [low + 1] * tenths + [low] * (10 - tenths) if tenths else [low]


def engine(model: str, speculative_config=None, **kw) -> LLM:
    """No prefix caching: each case runs the same prompts, which would otherwise skip their prefill
    after the first."""
    dummy = model in PRESETS
    return LLM(model, load_format="dummy" if dummy else "auto", skip_tokenizer_init=dummy,
               speculative_config=speculative_config, max_model_len=kw.pop("max_model_len", 2048),
               enable_prefix_caching=False, **kw)


def timed(llm: LLM, prompts, params) -> tuple[float, list]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


def counters(llm: LLM) -> dict:
    d = llm.core  # the verify core's counters
    return dict(drafts=d.num_drafts, draft_tokens=d.num_draft_tokens,
                accepted=d.num_accepted_tokens)


def tokens_per_step(before: dict, after: dict, generated: int, num_seqs: int) -> float | None:
    """Tokens a decode step keeps for a sequence: generated tokens past the prefill's first, per
    sequence-step (a verify step with proposals counts its kept run, one without counts 1)."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    decoded = generated - num_seqs  # the prefill samples each sequence's first token
    steps = decoded - accepted  # each sequence-step keeps 1 + its accepted proposals
    return round(decoded / steps, 3) if steps > 0 and drafts else None


def oracle(args) -> list[dict]:
    """Per model: the plain engine (async scheduling, the default) at each batch, then one engine
    with verify steps whose proposer is swapped: none (the synchronous loop alone), the oracle at
    each acceptance, n-gram lookup."""
    rows = []
    for model in args.model:
        workloads, plain = {}, {}
        greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm = engine(model, async_scheduling=None)
        high = min(10000, llm.config.hf_config.vocab_size)  # random token ids in [low, high)
        low = min(1000, high // 4)
        for batch in args.batch:
            rng = Random(batch)
            prompts = [[rng.randrange(low, high) for _ in range(args.prompt_len)]
                       for _ in range(batch)]
            warm = [[rng.randrange(low, high) for _ in range(args.prompt_len)] for _ in prompts]
            llm.generate(warm, greedy, use_tqdm=False)  # the timed run's shapes, other tokens
            seconds, outputs = timed(llm, prompts, greedy)
            refs = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outputs)}
            workloads[batch] = (prompts, warm, refs)
            plain[batch] = batch * args.output_len / seconds
            rows.append(dict(model=model, batch=batch, proposer="none", k=0, accept=1.0,
                             tok_per_s=round(plain[batch], 1), speedup=1.0,
                             async_scheduling=llm.config.async_scheduling))
            print(json.dumps(rows[-1]), flush=True)
        llm.exit()
        most = args.k[0] if args.k else max(1, int(max(args.accept) + .99) - 1)
        # max_num_seqs left at 512: the decode graphs cover up to 512 rows, a verify step's too
        llm = engine(model, dict(NGRAM, num_speculative_tokens=max(most, 4)))
        vocab = llm.config.hf_config.vocab_size
        for batch in args.batch:
            prompts, warm, refs = workloads[batch]
            # none: the verify engine without proposals; rejected: 4 wrong proposals a step
            cases = [("none", 1, 0), ("rejected", 1, 4)] + [
                ("oracle", a, args.k[0] if args.k else max(1, int(a + .99) - 1))
                for a in args.accept if a > 1] + [("ngram", 0, 4)]
            for proposer, mean, k in cases:
                llm.core.drafter = (NgramDrafter(NGRAM) if proposer == "ngram" else
                                    OracleDrafter(refs, k, accept_cycle(mean), vocab))
                llm.generate(warm, greedy, use_tqdm=False)  # its proposals all rejected (no refs)
                before = counters(llm)
                profile = cProfile.Profile() if args.profile else None
                with profile or contextlib.nullcontext():
                    seconds, outputs = timed(llm, prompts, greedy)
                after = counters(llm)
                if profile:  # where the host's time goes (a synchronous step waits for it)
                    print(f"-- {model} batch {batch} {proposer} k={k}", file=sys.stderr)
                    stats = pstats.Stats(profile, stream=sys.stderr)
                    stats.sort_stats(os.environ.get("SPEC_PROFILE_SORT", "tottime")).print_stats(
                        int(os.environ.get("SPEC_PROFILE_LINES", 25)))
                same = sum(o.outputs[0].token_ids == refs[tuple(p)]
                           for p, o in zip(prompts, outputs))
                total = batch * args.output_len
                rows.append(dict(model=model, batch=batch, proposer=proposer,
                                 k=llm.core.drafter.num_lookahead_slots,
                                 accept=tokens_per_step(before, after, total, batch) or 1.0,
                                 tok_per_s=round(total / seconds, 1),
                                 speedup=round(total / seconds / plain[batch], 3),
                                 same_as_plain=f"{same}/{batch}",
                                 async_scheduling=llm.config.async_scheduling))
                print(json.dumps(rows[-1]), flush=True)
        llm.exit()
    return rows


def heldout(args) -> list[dict]:
    """Each held-out file's first tokens continued, ``batch`` files at a time; plain, then n-gram
    lookup with each ``--k``."""
    from nanovllm.demo import builtin_model_path
    model = builtin_model_path("nanovllm:demo")
    folder = os.path.join(model, "heldout")
    rows, plain = [], {}
    greedy = SamplingParams(temperature=args.temperature, seed=0 if args.temperature else None,
                            max_tokens=args.output_len, ignore_eos=True)
    configs = [None] + [dict(NGRAM, num_speculative_tokens=k) for k in args.k or [2, 4, 8]]
    configs += [{"model": args.draft, "num_speculative_tokens": k}
                for k in (args.k or [2, 4, 8]) if args.draft]
    for config in configs:
        k = config["num_speculative_tokens"] if config else 0
        llm = LLM(model, speculative_config=config, async_scheduling=args.async_scheduling)
        prompts = [llm.tokenizer.encode(open(os.path.join(folder, name)).read())[:args.prompt_len]
                   for name in sorted(os.listdir(folder))]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        for batch in args.batch:
            before = counters(llm) if k else None
            seconds, tokens = 0.0, []
            for i in range(0, len(prompts), batch):
                spent, outputs = timed(llm, prompts[i:i + batch], greedy)
                seconds += spent
                tokens += [o.outputs[0].token_ids for o in outputs]
            total = sum(map(len, tokens))
            row = dict(model="nanovllm:demo", batch=batch, files=len(prompts),
                       async_scheduling=llm.config.async_scheduling,
                       temperature=args.temperature,
                       proposer=(config.get("method", "draft") if k else "none"), k=k,
                       tok_per_s=round(total / seconds, 1),
                       device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
            if k:
                after = counters(llm)
                row.update(speculative_config=config,
                           accept=tokens_per_step(before, after, total, len(prompts)),
                           acceptance_rate=round((after["accepted"] - before["accepted"])
                                                 / max(1, after["draft_tokens"]
                                                       - before["draft_tokens"]), 3),
                           speedup=round(total / seconds / plain[batch][0], 3))
                if not args.temperature:  # sampled: the same distribution, other draws
                    row["same_as_plain"] = tokens == plain[batch][1]
            else:
                plain[batch] = (total / seconds, tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
        llm.exit()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--oracle", action="store_true")
    mode.add_argument("--heldout", action="store_true")
    parser.add_argument("--model", nargs="+", default=["qwen3-0.6b"])
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--accept", type=float, nargs="+", default=[2, 3, 4],
                        help="tokens kept a verify step, the target's own included (--oracle)")
    parser.add_argument("--k", type=int, nargs="+", default=None,
                        help="proposals a step (--oracle: one, default accept - 1, all kept; "
                             "--heldout: each, default 2 4 8)")
    parser.add_argument("--draft", default=None,
                        help="--heldout: also a draft model (e.g. nanovllm:demo-draft)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="--heldout: sample at this temperature (seed 0) instead of greedy")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="--heldout: with async scheduling (the plain run's too; default off)")
    parser.add_argument("--profile", action="store_true",
                        help="--oracle: each verify run's host profile (cProfile) on stderr, "
                             "sorted by SPEC_PROFILE_SORT (default tottime), SPEC_PROFILE_LINES "
                             "lines (default 25)")
    parser.add_argument("--out", help="also write the JSON lines here")
    args = parser.parse_args()
    if args.oracle:
        args.batch = args.batch or [1, 4, 16, 64]
        args.prompt_len, args.output_len = args.prompt_len or 512, args.output_len or 256
    else:
        args.batch = args.batch or [1, 4]
        args.prompt_len, args.output_len = args.prompt_len or 256, args.output_len or 256
    rows = oracle(args) if args.oracle else heldout(args)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{device}, {date}")
    print(f"{'model':<16}{'batch':>6} {'proposer':<9}{'k':>3}{'tok/step':>10}{'tok/s':>10}"
          f"{'speed-up':>10}")
    for r in rows:
        print(f"{r['model']:<16}{r['batch']:>6} {r['proposer']:<9}{r.get('k', '-')!s:>3}"
              f"{r.get('accept') or '-'!s:>10}{r['tok_per_s']:>10}{r.get('speedup', 1.0)!s:>10}")


if __name__ == "__main__":
    main()
