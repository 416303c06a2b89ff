"""Beam search (nanovllm/beam_search.py, LLM.beam_search), CPU only: against vLLM's algorithm
computed with transformers' log-softmax step by step, against an enumeration of every two-token
continuation, against greedy decoding, on a checkpoint whose EOS is likely (finished beams), and on
a fake engine with a known table of logprobs."""
from __future__ import annotations

import math
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import CPU_ENGINE

from nanovllm.features.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    beam_search,
    get_beam_search_score,
)
from nanovllm.outputs import CompletionOutput, Logprob

EOS = 256  # the tiny checkpoints' tokenizer EOS (<|endoftext|>)
TOL = 1e-4  # logprobs: the engine's float32 against transformers' float32 logits
PROMPTS = [[7, 100, 33, 250, 12], [3, 9], [200, 1, 5, 60, 61, 62, 63, 64]]


# ---- the references ----------------------------------------------------------------------------
def reference_beam_search(next_logprobs, prompt, beam_width, max_tokens, eos=EOS, ignore_eos=False,
                          length_penalty=1.0):
    """vLLM's beam search, written out: each live beam's candidates are its top 2 * beam_width next
    tokens; one ending in EOS is finished; the best beam_width of the rest live on (score: cum / len
    ** length_penalty, len without a final EOS); at the end finished and live are ranked together.
    ``next_logprobs(token lists)`` is the model: a [n, vocab] float64 tensor of next-token logprobs.
    Returns [(tokens, cum_logprob)], best first."""
    def score(beam):
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] == eos)) ** length_penalty

    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        rows = next_logprobs([tokens for tokens, _ in live])
        candidates = []
        for (tokens, cum), row in zip(live, rows):
            for t in row.topk(2 * beam_width).indices.tolist():
                new = (tokens + [t], cum + float(row[t]))
                (done if t == eos and not ignore_eos else candidates).append(new)
        live = sorted(candidates, key=score, reverse=True)[:beam_width]
    return sorted(done + live, key=score, reverse=True)[:beam_width]


def hf_next_logprobs(model):
    @torch.no_grad()
    def next_logprobs(seqs):  # a search's live beams all have one length
        return torch.log_softmax(model(torch.tensor(seqs)).logits[:, -1].double(), dim=-1)
    return next_logprobs


def assert_same_beams(got: BeamSearchOutput, expected, tol=TOL):
    assert len(got.sequences) == len(expected)
    for seq, (tokens, cum) in zip(got.sequences, expected, strict=True):
        assert seq.tokens == tokens
        assert seq.cum_logprob == pytest.approx(cum, abs=tol)


def beams_of(output: BeamSearchOutput):
    return [(s.tokens, s.cum_logprob) for s in output.sequences]


def scores(output: BeamSearchOutput, length_penalty, eos=EOS):
    return [get_beam_search_score(s.tokens, s.cum_logprob, eos, length_penalty)
            for s in output.sequences]


# ---- engines -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny):
    from nanovllm import LLM
    engine = LLM(tiny, **CPU_ENGINE)
    yield engine
    engine.exit()


EOS_PROMPT = [40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def eos_checkpoint(tiny, oracle, tmp_path_factory):
    """The tiny checkpoint with EOS's LM-head row set to that of the greedy first token after
    EOS_PROMPT (plus a little noise): EOS then ranks near the top wherever that token does, so beams
    end on it."""
    from safetensors.torch import load_file, save_file
    path = str(tmp_path_factory.mktemp("eos") / "ckpt")
    shutil.copytree(tiny, path)
    first = oracle.greedy(tiny, EOS_PROMPT, 1)[0][0]
    weights = load_file(os.path.join(path, "model.safetensors"))
    head = weights["lm_head.weight"]
    head[EOS] = head[first] + 0.01 * torch.randn(head.shape[1],
                                                 generator=torch.Generator().manual_seed(0))
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def eos_llm(eos_checkpoint):
    from nanovllm import LLM
    engine = LLM(eos_checkpoint, **CPU_ENGINE)
    yield engine
    engine.exit()


# ---- against transformers ----------------------------------------------------------------------
@pytest.mark.parametrize("beam_width,length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_matches_reference(llm, tiny, oracle, beam_width, length_penalty):
    params = BeamSearchParams(beam_width=beam_width, max_tokens=5, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    ref = hf_next_logprobs(oracle.model(tiny))
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        assert_same_beams(out, reference_beam_search(ref, prompt, beam_width, 5,
                                                     length_penalty=length_penalty))
        assert scores(out, length_penalty) == sorted(scores(out, length_penalty), reverse=True)
        # vLLM's tokens: prompt + completion; logprobs: one entry per completion token
        for seq in out.sequences:
            assert seq.tokens[:len(prompt)] == prompt and len(seq.tokens) == len(prompt) + 5
            assert len(seq.logprobs) == 5 and seq.finish_reason == "length" \
                and seq.stop_reason is None
            completion = seq.tokens[len(prompt):]
            assert all(t in entry and len(entry) == 2 * beam_width
                       for t, entry in zip(completion, seq.logprobs))
            assert seq.cum_logprob == pytest.approx(sum(float(e[t])
                                                        for t, e in zip(completion, seq.logprobs)))
            assert seq.text == llm.tokenizer.decode(seq.tokens)


def test_beam_width_one_is_greedy(llm, tiny, oracle):
    outputs = llm.beam_search(PROMPTS,
                              BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        (seq,) = out.sequences
        assert seq.tokens == prompt + oracle.greedy(tiny, prompt, 6)[0]


def test_matches_enumeration_of_two_tokens(llm, tiny, oracle):
    """Every two-token continuation scored by transformers: the search returns the beam_width best
    whose first token is one of the beam_width best first tokens (those that survive step 1), and
    never beats the best of all."""
    model, prompt, beam_width = oracle.model(tiny), PROMPTS[0], 3
    with torch.no_grad():
        first = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        vocab = first.numel()
        seqs = torch.tensor([prompt + [t] for t in range(vocab)])
        second = torch.log_softmax(model(seqs).logits[:, -1].double(), -1)
    total = first[:, None] + second  # [first token, second token]
    survivors = first.topk(beam_width).indices.tolist()
    values, flat = total[survivors].flatten().topk(beam_width)
    expected = [(prompt + [survivors[i // vocab], i % vocab], float(v))
                for i, v in zip(flat.tolist(), values)]
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=beam_width, max_tokens=2,
                                                        ignore_eos=True))
    assert_same_beams(out, expected)
    best = float(total.max())
    assert out.sequences[0].cum_logprob <= best + TOL
    if int(total.argmax()) // vocab in survivors:
        assert out.sequences[0].cum_logprob == pytest.approx(best, abs=TOL)


def test_prompt_forms(llm):
    text = "def f(x):"
    ids = llm.tokenizer.encode(text)
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    outputs = llm.beam_search([text, {"prompt": text}, {"prompt_token_ids": ids}, ids], params)
    assert all(isinstance(o, BeamSearchOutput) for o in outputs)
    assert all(isinstance(s, BeamSearchSequence) for o in outputs for s in o.sequences)
    # the same search four times
    assert len({tuple(tuple(s.tokens) for s in o.sequences) for o in outputs}) == 1
    assert outputs[0].sequences[0].text.startswith(text)
    (single,) = llm.beam_search(text, params)  # one prompt, as generate takes it
    assert_same_beams(single, beams_of(outputs[0]))
    chunked = llm.beam_search([text, [1, 2, 3]], params, concurrency_limit=1)
    together = llm.beam_search([text, [1, 2, 3]], params)
    for a, b in zip(chunked, together, strict=True):
        assert_same_beams(a, beams_of(b))
    assert llm.beam_search([], params) == []


# ---- EOS ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_eos_ends_beams(eos_llm, eos_checkpoint, oracle, length_penalty):
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=length_penalty)
    (out,) = eos_llm.beam_search([EOS_PROMPT], params)
    expected = reference_beam_search(hf_next_logprobs(oracle.model(eos_checkpoint)), EOS_PROMPT, 3,
                                     5, length_penalty=length_penalty)
    assert_same_beams(out, expected)
    assert scores(out, length_penalty) == sorted(scores(out, length_penalty), reverse=True)
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped, "no beam ended on EOS"
    for seq in out.sequences:
        # ends on EOS, kept in tokens (vLLM's), not in the text by default
        if seq.finish_reason == "stop":
            assert seq.tokens[-1] == EOS and EOS not in seq.tokens[len(EOS_PROMPT):-1] \
                and seq.stop_reason == EOS
            assert len(seq.tokens) <= len(EOS_PROMPT) + 5
            assert seq.text == eos_llm.tokenizer.decode(seq.tokens[:-1])
        else:
            assert seq.finish_reason == "length" and len(seq.tokens) == len(EOS_PROMPT) + 5
            assert EOS not in seq.tokens[len(EOS_PROMPT):]
    params.include_stop_str_in_output = True
    (with_eos,) = eos_llm.beam_search([EOS_PROMPT], params)
    for a, b in zip(out.sequences, with_eos.sequences, strict=True):
        assert a.tokens == b.tokens
        assert b.text == eos_llm.tokenizer.decode(b.tokens)
        assert b.text.endswith("<|endoftext|>") == (b.finish_reason == "stop")


def test_length_penalty_orders_short_and_long(eos_llm):
    """No penalty (0) ranks by cum_logprob: an early EOS wins; a large one favours the long
    beams."""
    def best(length_penalty):
        (out,) = eos_llm.beam_search([EOS_PROMPT], BeamSearchParams(beam_width=3, max_tokens=6,
                                                                    length_penalty=length_penalty))
        assert scores(out, length_penalty) == sorted(scores(out, length_penalty), reverse=True)
        return out.sequences[0]
    short, long = best(0.0), best(4.0)
    assert short.finish_reason == "stop" and len(short.tokens) < len(long.tokens)
    assert short.cum_logprob > long.cum_logprob


def test_ignore_eos(eos_llm, eos_checkpoint, oracle):
    (out,) = eos_llm.beam_search([EOS_PROMPT],
                                 BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    expected = reference_beam_search(hf_next_logprobs(oracle.model(eos_checkpoint)), EOS_PROMPT, 3,
                                     5, ignore_eos=True)
    assert_same_beams(out, expected)
    assert all(s.finish_reason == "length" and len(s.tokens) == len(EOS_PROMPT) + 5
               for s in out.sequences)
    # EOS ranks first or second after EOS_PROMPT: here an ordinary token, a beam "length" (ranked by
    # cum_logprob with length_penalty 0; with 1, a final EOS still does not count in the length, as
    # in vLLM)
    params = BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True, length_penalty=0.0)
    (first,) = eos_llm.beam_search([EOS_PROMPT], params)
    assert first.sequences[0].tokens == EOS_PROMPT + [EOS] \
        and first.sequences[0].finish_reason == "length"
    assert_same_beams(first, reference_beam_search(hf_next_logprobs(oracle.model(eos_checkpoint)),
                                                   EOS_PROMPT, 2, 1, ignore_eos=True,
                                                   length_penalty=0.0))


# ---- the search's logic on a fake engine with a known table of logprobs --------------------------
class FakeEngine:
    """``generate`` over a vocabulary of 8 whose next-token logprobs depend on the last token only
    (a table)."""

    VOCAB = 8

    def __init__(self, max_model_len=64, eos=2):
        gen = torch.Generator().manual_seed(1)
        self.table = torch.log_softmax(3 * torch.randn(self.VOCAB, self.VOCAB, generator=gen,
                                                       dtype=torch.float64), -1)
        self.tokenizer = None
        self.config = SimpleNamespace(hf_config=SimpleNamespace(vocab_size=self.VOCAB),
                                      max_model_len=max_model_len,
                                      eos_token_ids=() if eos is None else (eos,))
        self.calls = []

    def _parse_prompt(self, i, prompt):
        return list(prompt), None

    def next_logprobs(self, seqs):
        return self.table[[s[-1] for s in seqs]]

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append((len(prompts), sampling_params))
        outs = []
        for prompt in prompts:
            ids = prompt["prompt_token_ids"]
            assert len(ids) < self.config.max_model_len
            row = self.table[ids[-1]]
            entry = {t: Logprob(row[t])
                     for t in row.topk(sampling_params.logprobs).indices.tolist()}
            outs.append(SimpleNamespace(outputs=[CompletionOutput(0, "", [0], None, [entry],
                                                                  "length")]))
        return outs


def test_fake_engine_objects_and_eos():
    engine = FakeEngine()
    params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.7)
    prompts = [[0], [5, 1]]
    outputs = beam_search(engine, prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert_same_beams(out, reference_beam_search(engine.next_logprobs, prompt, 2, 4, eos=2,
                                                     length_penalty=0.7),
                          tol=1e-12)
        assert all(type(s.cum_logprob) is float for s in out.sequences)
        assert all(s.text == "" for s in out.sequences)  # no tokenizer
    reasons = [(s.tokens[-1], s.finish_reason, s.stop_reason) for o in outputs for s in o.sequences]
    # the config's EOS ends beams
    assert (2, "stop", 2) in reasons and any(r == "length" for _, r, _ in reasons)
    # one generate per step over every live beam of every prompt: 1 + 1, then 2 + 2, ...
    assert [n for n, _ in engine.calls] == [2, 4, 4, 4]
    sp = engine.calls[0][1]
    assert (sp.max_tokens, sp.logprobs, sp.temperature) == (1, 4, 0.0)


def test_fake_engine_max_model_len():
    engine = FakeEngine(max_model_len=4, eos=None)
    (out,) = beam_search(engine, [[0, 1]], BeamSearchParams(beam_width=2, max_tokens=10),
                         use_tqdm=True)
    assert all(len(s.tokens) == 4 and s.finish_reason == "length" for s in out.sequences)
    assert len(engine.calls) == 2


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,error,name", [
    (dict(beam_width=0), ValueError, "beam_width"),
    (dict(beam_width=-2), ValueError, "beam_width"),
    (dict(beam_width=2.0), TypeError, "beam_width"),
    (dict(beam_width=True), TypeError, "beam_width"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens="4"), TypeError, "max_tokens"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature=math.nan), ValueError, "temperature"),
    (dict(length_penalty=math.inf), ValueError, "length_penalty"),
    (dict(length_penalty="1"), TypeError, "length_penalty"),
    (dict(ignore_eos=1), TypeError, "ignore_eos"),
    (dict(include_stop_str_in_output="yes"), TypeError, "include_stop_str_in_output"),
])
def test_bad_params(kwargs, error, name):
    with pytest.raises(error, match=name):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


def test_length_penalty_whose_score_would_overflow_is_refused_by_name():
    """The score divides by len ** length_penalty: a value for which that overflows or vanishes at a
    length up to max_model_len is refused before any step; the values below the bound run to
    max_model_len with vLLM's score."""
    for bad in (500.0, -1e6, 160, -160):
        engine = FakeEngine(max_model_len=64, eos=None)
        with pytest.raises(ValueError, match=f"length_penalty={bad} .*max_model_len=64"):
            beam_search(engine, [[0]], BeamSearchParams(beam_width=2, max_tokens=70,
                                                        length_penalty=bad))
        assert not engine.calls
    for ok in (150.0, -150.0, 2.0):
        engine = FakeEngine(max_model_len=64, eos=None)
        params = BeamSearchParams(beam_width=2, max_tokens=70, length_penalty=ok)
        (out,) = beam_search(engine, [[0]], params)
        assert all(len(s.tokens) == 64
                   and math.isfinite(get_beam_search_score(s.tokens, s.cum_logprob, None, ok))
                   for s in out.sequences)
        assert_same_beams(out, reference_beam_search(engine.next_logprobs, [0], 2, 63, eos=None,
                                                     length_penalty=ok),
                          tol=1e-12)


def test_bad_calls(llm):
    ok = BeamSearchParams(beam_width=2, max_tokens=2)
    assigned = BeamSearchParams(beam_width=2, max_tokens=2)
    assigned.beam_width = 0  # checked again by the search
    vocab = llm.config.hf_config.vocab_size
    cases = [
        (([[1, 2]], assigned), ValueError, "beam_width"),
        (([[1, 2]], BeamSearchParams(beam_width=vocab // 2 + 1, max_tokens=1)), ValueError,
         "beam_width"),
        (([[1, 2]], {"beam_width": 2, "max_tokens": 2}), TypeError, "BeamSearchParams"),
        (([{"prompt": "a", "images": []}], ok), ValueError, "images"),
        (([{"prompt": 5}], ok), TypeError, "prompt 0"),
        (([{"text": "a"}], ok), ValueError, "prompt 0"),
        (([[1, 2], []], ok), ValueError, "prompt 1: the decoder prompt cannot be empty"),
        (([[1, 2], [1, vocab]], ok), ValueError,
         f"prompt 1: token id {vocab} is out of vocabulary"),
        ((["\ud800"], ok), ValueError, "prompt 0 is not valid Unicode text"),
        (([[1] * llm.config.max_model_len], ok), ValueError, "max_model_len"),
        (([1.5], ok), TypeError, "prompt 0"),
        ((42, ok), TypeError, "prompts"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            llm.beam_search(*args)
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([[1, 2]], ok, concurrency_limit=0)
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([[1, 2]], ok, lora_request=object())
    assert llm.is_finished()  # nothing was admitted
