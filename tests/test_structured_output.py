"""Structured outputs (``SamplingParams(structured_outputs=StructuredOutputsParams(...))``, vLLM's
API, compiled by xgrammar): every output that ends by EOS is complete and valid (JSON that parses
and validates against its schema, a full regex match, one of the choices, a sentence of the EBNF
grammar), a max_tokens cut says "length", free requests in the same batches are unchanged by their
constrained neighbours, and the outputs are the same with async scheduling on and off, under
preemption, with n > 1, stop strings, logprobs and TP=2. On the shipped demo model (a byte-level BPE
tokenizer of 4,096 tokens) and a tiny random checkpoint whose model vocabulary (320) exceeds its
tokenizer's (259)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys

import pytest
import torch
from conftest import CPU_ENGINE, ENGINE, assert_no_leaks

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine.sequence import Sequence
from nanovllm.features.bitmask_handoff import BitmaskHandoff, PendingFill
from nanovllm.features.structured_output import (
    StructuredOutputManager,
    apply_token_bitmask,
    choice_grammar,
)
from nanovllm.sampling_params import StructuredOutputsParams as FromModule

# a guard for users without the extras (pip install -e ".[test,structured]"); CI installs both
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

# nested objects, arrays, enums, integers with bounds and numbers; strings kept short so that greedy
# decoding of a code model ends them
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "pos": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"]},
        "owners": {"type": "array", "maxItems": 2, "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}},
            "required": ["id", "admin"]}},
    },
    "required": ["name", "age", "kind", "tags", "pos", "owners"],
}
# a small one for the mixed batches: a few tokens per output
SMALL_SCHEMA = {"type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]},
                               "n": {"type": "integer", "minimum": 0, "maximum": 99},
                               "ok": {"type": "boolean"}}, "required": ["kind", "n", "ok"]}
REGEX = r"[a-z]{2,8}@[a-z]{2,8}\.(com|org|net)"
CHOICES = ["True", "False", "None", "NotImplemented"]
# one to four assignments separated by commas: `name=digits` or `name="letters"` (bounded, so that
# outputs end)
EBNF = '''root ::= item ("," item){0,3}
item ::= name "=" (number | text)
name ::= [a-z] [a-z_]{0,7}
number ::= [1-9] [0-9]{0,5} | "0"
text ::= "\\"" [a-zA-Z ]{0,12} "\\""'''
EBNF_SENTENCE = re.compile(
    r'([a-z][a-z_]{0,7}=([1-9][0-9]{0,5}|0|"[a-zA-Z ]{0,12}")(,(?!$)|$)){1,4}')
PROMPTS = ["config = ", "def f(x):\n    return ", "data = json.loads('", "# the answer\n",
           "class A:\n    x = ", "import os\n\n", "if __name__ == '__main__':\n    ", "values = ["]


def constrained(max_tokens: int = 100, temperature: float = 0.0, sampling: dict | None = None,
                **constraint) -> SamplingParams:
    """A request under ``constraint`` (StructuredOutputsParams' fields), with ``sampling``'s other
    fields."""
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          seed=7 if temperature else None,
                          structured_outputs=StructuredOutputsParams(**constraint),
                          **(sampling or {}))


def json_params(temperature: float = 0.0, max_tokens: int = 100, **sampling) -> SamplingParams:
    return constrained(max_tokens, temperature, sampling, json=SCHEMA, disable_any_whitespace=True)


def assert_valid(kind: str, text: str, schema: dict = SCHEMA):
    if kind == "json":
        jsonschema.validate(json.loads(text), schema)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        assert EBNF_SENTENCE.fullmatch(text), text
    else:
        assert isinstance(json.loads(text), dict), text


def params_of(kind: str, temperature: float = 0.0, max_tokens: int = 100) -> SamplingParams:
    if kind == "json":
        return json_params(temperature, max_tokens)
    constraint = {"regex": REGEX, "choice": CHOICES, "grammar": EBNF, "json_object": True}[kind]
    extra = {"disable_any_whitespace": True} if kind == "json_object" else {}
    return constrained(max_tokens, temperature, **{kind: constraint}, **extra)


@pytest.fixture(scope="module")
def demo():
    engine = LLM("nanovllm:demo", dtype="float32", num_kvcache_blocks=64, kvcache_block_size=16)
    yield engine
    engine.exit()


# ---- the parameters ------------------------------------------------------------------------------
def test_params_are_vllms_and_checked():
    assert FromModule is StructuredOutputsParams
    assert StructuredOutputsParams(json='{"type": "integer"}').kind == "json"
    assert StructuredOutputsParams(choice=("a", "b")).kind == "choice"
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, "
                                         "json_object, structural_tag; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="structural_tag is not supported"):
        StructuredOutputsParams(structural_tag='{"structures": []}')
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams(json={}, whitespace_pattern=r"\s*")
    # vLLM's flag for its guidance backend, to refuse unlisted properties as xgrammar always does:
    # accepted
    assert StructuredOutputsParams(json={}, disable_additional_properties=True).kind == "json"
    with pytest.raises(TypeError, match="disable_additional_properties must be a bool"):
        StructuredOutputsParams(json={}, disable_additional_properties="yes")
    with pytest.raises(ValueError, match=r"structured_outputs.json is not valid JSON .*'\{nope'"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(TypeError, match="structured_outputs.json must be a JSON schema"):
        StructuredOutputsParams(json=3)
    with pytest.raises(TypeError, match="structured_outputs.json must be JSON-serializable .*set"):
        StructuredOutputsParams(json={"enum": {1, 2}})
    with pytest.raises(TypeError, match=r"choice must be a non-empty list of non-empty strings, "
                                        r"got \['a', 1\]"):
        StructuredOutputsParams(choice=["a", 1])
    with pytest.raises(TypeError, match="choice must be"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(TypeError, match="regex must be a non-empty string, got 5"):
        StructuredOutputsParams(regex=5)
    with pytest.raises(ValueError, match="json_object must be True when given, got False"):
        StructuredOutputsParams(json_object=False)
    with pytest.raises(TypeError, match="disable_any_whitespace must be a bool, got 'yes'"):
        StructuredOutputsParams(json={}, disable_any_whitespace="yes")
    # the grammar decides where the output ends: settings against that are refused by name
    so = StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError,
                       match="ignore_eos=True cannot be honoured with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=so)
    with pytest.raises(ValueError, match="min_tokens=2 cannot be honoured with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=so)
    with pytest.raises(TypeError,
                       match="structured_outputs must be a StructuredOutputsParams, got"):
        SamplingParams(structured_outputs={"json": {}})
    sp = SamplingParams(structured_outputs=so)
    so.regex = None  # assigned after construction: checked again at admission
    with pytest.raises(ValueError, match="got none"):
        sp.verify()


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_grammar(['a"b', "c\\d", "é"]) == 'root ::= "a\\"b" | "c\\\\d" | "é"'


def test_apply_token_bitmask_matches_a_loop():
    """Bit t % 32 of word t // 32 allows token t (xgrammar's layout), for a vocabulary that is not a
    multiple of 32; a row of all ones changes nothing; 40 rows span three chunks of the
    unpacking."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 70, generator=gen)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (40, 3), dtype=torch.int32, generator=gen)
    bitmask[1] = -1
    expected = logits.clone()
    for b in range(40):
        for t in range(70):
            if not (int(bitmask[b, t // 32]) >> (t % 32)) & 1:
                expected[b, t] = float("-inf")
    got = apply_token_bitmask(logits.clone(), bitmask)
    assert torch.equal(got, expected) and torch.equal(got[1], logits[1])
    assert torch.isinf(got[0]).any() and torch.isinf(got[2]).any() and torch.isinf(got[39]).any()
    # the Triton kernel (the interpreter on CPU), in blocks
    if importlib.util.find_spec("triton") is not None:
        from nanovllm.kernels import (
            triton_sampler,  # that split a word's bits and end past the vocabulary
        )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        wide = torch.randn(40, 100, generator=gen)
        got = wide.to(device)
        # rows 100 apart
        triton_sampler.apply_token_bitmask(got[:, :70], bitmask.to(device), block=16)
        assert torch.equal(got[:, :70].cpu(), apply_token_bitmask(wide[:, :70].clone(), bitmask))
        assert torch.equal(got[:, 70:].cpu(), wide[:, 70:])  # past the vocabulary: untouched


def test_wait_for_flag_holds_until_the_host_raises_it():
    """triton_sampler.wait_for_flag (the interpreter on CPU, the GPU on CUDA) returns only once
    another thread has raised the flag to the ticket, and a copy enqueued after it carries what that
    thread wrote before; with the flag never raised it gives up after max_polls instead of
    hanging."""
    import threading
    import time
    triton_sampler = pytest.importorskip("nanovllm.kernels.triton_sampler")
    cuda = torch.cuda.is_available()
    flag, gave_up = (torch.zeros(1, dtype=torch.int64, pin_memory=cuda) for _ in range(2))
    host = torch.zeros(64, dtype=torch.int32, pin_memory=cuda)
    seen = torch.empty(64, dtype=torch.int32, device="cuda" if cuda else "cpu")

    def write():
        time.sleep(0.2)
        host.copy_(torch.arange(64, dtype=torch.int32))
        flag.numpy()[0] = 3

    writer = threading.Thread(target=write)
    writer.start()
    triton_sampler.wait_for_flag(flag, gave_up, 3)
    seen.copy_(host, non_blocking=True)
    if cuda:
        torch.cuda.synchronize()
    writer.join()
    assert torch.equal(seen.cpu(), torch.arange(64, dtype=torch.int32)) and int(gave_up[0]) == 0
    # never raised: it returns, and says so
    triton_sampler.wait_for_flag(flag, gave_up, 4, max_polls=50)
    if cuda:
        torch.cuda.synchronize()
    assert int(gave_up[0]) == 4


def test_the_triton_sampler_never_picks_a_masked_token():
    """A constrained batch of temperatures only stays on the fast path (one Triton pass, CUDA): it
    samples the masked logits, greedy and sampled rows alike, and never a disallowed token (the
    interpreter on CPU)."""
    triton_sampler = pytest.importorskip("nanovllm.kernels.triton_sampler")
    gen = torch.Generator().manual_seed(3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(8, 200, generator=gen).to(torch.bfloat16)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (8, 7), dtype=torch.int32, generator=gen) & \
        torch.randint(-2 ** 31, 2 ** 31 - 1, (8, 7), dtype=torch.int32,
                      generator=gen)  # a quarter allowed
    masked = apply_token_bitmask(logits.to(device), bitmask.to(device))
    allowed = torch.isfinite(masked.float()).cpu()
    temperatures = torch.tensor([0.0, 1.0] * 4, device=device)
    for seed in range(3):
        got = triton_sampler.sample(masked, temperatures, seed=seed, quarter=16).cpu()
        assert allowed[torch.arange(8), got].all(), got
    assert torch.equal(got[::2], masked.float().argmax(-1).cpu()[::2])


# ---- validity ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar", "json_object"])
def test_outputs_are_valid_greedy_and_sampled(demo, kind):
    """Greedy and seeded sampled outputs of every constraint end by EOS ("stop") and are valid."""
    for temperature in (0.0, 0.9):
        outs = demo.generate(PROMPTS[:5], params_of(kind, temperature), use_tqdm=False)
        reasons = [out.outputs[0].finish_reason for out in outs]
        # a sampled JSON number, or any JSON object's content, may run on (neither has a length
        # limit): then max_tokens ends it, as "length"; the bounded constraints end greedy outputs
        # by EOS
        bounded = temperature == 0 and kind != "json_object"
        assert reasons.count("stop") >= (len(outs) if bounded else len(outs) // 2), (
            kind, temperature, reasons)
        for out in outs:
            c = out.outputs[0]
            if c.finish_reason == "length":
                assert len(c.token_ids) == 100
                continue
            assert c.finish_reason == "stop" and c.stop_reason is None, (kind, temperature, c.text)
            assert c.token_ids[-1] == demo.tokenizer.eos_token_id
            assert_valid(kind, c.text)
    assert_no_leaks(demo)


def test_max_tokens_cut_is_length(demo):
    outs = demo.generate(PROMPTS[:3], json_params(max_tokens=6), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 6 and c.text.startswith('{"name')
        with pytest.raises(json.JSONDecodeError):  # cut short: not (yet) JSON
            json.loads(c.text)


def test_stop_strings_still_end_a_constrained_output(demo):
    outs = demo.generate(PROMPTS[:3], json_params(stop=['"age"']), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert (c.finish_reason == "stop" and c.stop_reason == '"age"'
                and c.text.startswith('{"name": "'))
        assert c.text.endswith('", ') and '"age"' not in c.text


def test_n_completions_each_follow_the_grammar(demo):
    params = constrained(40, 1.0, {"n": 4}, json=SMALL_SCHEMA, disable_any_whitespace=True)
    outs = demo.generate(PROMPTS[:2], params, use_tqdm=False)
    for out in outs:
        texts = [c.text for c in out.outputs]
        # each completion its own matcher and noise
        assert len(texts) == 4 and len(set(texts)) > 1, texts
        for c in out.outputs:
            assert c.finish_reason == "stop"
            assert_valid("json", c.text, SMALL_SCHEMA)


def test_logprobs_are_those_of_the_constrained_distribution(demo):
    """As vLLM's: the mask is applied before logprobs, so a choice's first token has all the
    probability mass among the tokens that begin a choice, and every other token of the top k is at
    -inf."""
    params = constrained(10, sampling={"logprobs": 8}, choice=CHOICES)
    out = demo.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES
    first = out.logprobs[0]
    finite = {t: lp for t, lp in first.items() if math.isfinite(lp)}
    tok = demo.tokenizer
    pieces = {t: tok.convert_tokens_to_string([tok.convert_ids_to_tokens(t)])
              for t in range(len(tok))}
    starts = {t for t, piece in pieces.items() if piece
              and any(c.startswith(piece) for c in CHOICES)}
    assert set(finite) <= starts and out.token_ids[0] in finite and len(finite) > 1
    assert sum(math.exp(lp) for lp in finite.values()) == pytest.approx(1.0, abs=1e-4)
    assert all(lp == -math.inf for t, lp in first.items() if t not in finite)
    last = out.logprobs[-1]  # only EOS may end a complete choice
    assert (out.token_ids[-1] == demo.tokenizer.eos_token_id
            and last[out.token_ids[-1]] == pytest.approx(0.0, abs=1e-5))


def test_prefix_cache_hits_leave_constrained_outputs_alone(demo):
    """A prompt whose first block comes from the prefix cache gets the same constrained output
    (greedy)."""
    prompt = ("import json\n\ndef load(path):\n    with open(path) as f:\n"
              "        return json.load(f)\n\nconfig = ")
    assert len(demo.tokenizer.encode(prompt)) > 16  # at least one full block of 16 tokens
    first = demo.generate([prompt], json_params(), use_tqdm=False)[0]
    again = demo.generate([prompt, prompt], json_params(), use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in again)
    for out in [first, *again]:
        assert (out.outputs[0].finish_reason == "stop"
                and out.outputs[0].text == first.outputs[0].text)
    assert_valid("json", first.outputs[0].text)


# ---- mixed batches, async scheduling, preemption -------------------------------------------------
FREE = [SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=4, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, presence_penalty=0.5)]


def _mixed_workload():
    """Free requests (greedy, sampled, top-k/top-p with logprobs, penalties) between constrained
    ones of each kind, greedy and sampled."""
    kinds = [("json", SMALL_SCHEMA), ("regex", REGEX), ("choice", CHOICES), ("grammar", EBNF)]
    prompts, params = [], []
    for i, prompt in enumerate(PROMPTS):
        kind, constraint = kinds[i % len(kinds)]
        prompts += [prompt, prompt]
        params += [FREE[i % len(FREE)], constrained(60, 0.8 if i % 3 == 1 else 0.0,
                                                    disable_any_whitespace=True,
                                                    **{kind: constraint}) if kind == "json" else
                   constrained(60, 0.8 if i % 3 == 1 else 0.0, **{kind: constraint})]
    return prompts, params


def _comparable(outputs):
    """Texts, tokens, finish reasons and the token ids of logprob entries (exact); the logprobs,
    apart."""
    exact = [[(c.text, c.token_ids, c.finish_reason, [list(e) for e in c.logprobs or ()])
              for c in o.outputs]
             for o in outputs]
    return exact, [lp for o in outputs for c in o.outputs for e in c.logprobs or ()
                   for lp in e.values()]


def assert_same(got, expected):
    """The same outputs; logprobs within 1e-4 (a row's float sums depend on its batch)."""
    assert got[0] == expected[0]
    assert got[1] == pytest.approx(expected[1], abs=1e-4)


def test_free_requests_are_unchanged_by_constrained_neighbours(demo, monkeypatch):
    """Greedy, seeded, top-k/top-p and penalty requests give the same outputs beside constrained
    ones as alone, and alone their batches have no bitmask (nothing is filled, the sampler gets
    none)."""
    prompts, params = _mixed_workload()
    mixed = demo.generate(prompts, params, use_tqdm=False)
    free = [i for i, sp in enumerate(params) if sp.structured_outputs is None]
    bitmasks, sampler = [], demo.model_runner.sampler
    for fill in ("grammar_bitmask", "grammar_bitmask_async"):
        monkeypatch.setattr(demo.install("structured_outputs").manager, fill,
                            lambda *a: pytest.fail("a bitmask was filled"))
    monkeypatch.setattr(demo.model_runner, "sampler",
                        lambda logits, b, g: bitmasks.append(b.masks) or
                        sampler(logits, b, g))
    alone = demo.generate([prompts[i] for i in free], [params[i] for i in free], use_tqdm=False)
    monkeypatch.undo()
    assert bitmasks and not any(bitmasks)
    assert_same(_comparable([mixed[i] for i in free]), _comparable(alone))
    con = [i for i in range(len(params)) if i not in free]
    for i in con:
        assert mixed[i].outputs[0].finish_reason == "stop"
        assert_valid(params[i].structured_outputs.kind, mixed[i].outputs[0].text, SMALL_SCHEMA)
    alone = demo.generate([prompts[i] for i in con], [params[i] for i in con], use_tqdm=False)
    assert_same(_comparable([mixed[i] for i in con]), _comparable(alone))


def test_a_fill_slower_than_the_forward_changes_nothing(monkeypatch):
    """Every fill made to take 30 ms, longer than the demo's forward: with the handoff the sampler
    waits for it (on CUDA the device spins on the handoff's flag while the host launches on; on the
    CPU the launch waits), and the outputs are exactly those of the sampler launched after its
    fill."""
    import time

    from nanovllm.features import structured_output
    prompts, params = _mixed_workload()
    fill_rows = structured_output.fill_rows

    def slow(rows, bitmask, *args, **kwargs):
        time.sleep(0.03)
        return fill_rows(rows, bitmask, *args, **kwargs)

    monkeypatch.setattr(structured_output, "fill_rows", slow)
    results = []
    for hand_off in (False, True):
        llm = LLM("nanovllm:demo", dtype="float32", num_kvcache_blocks=64, kvcache_block_size=16,
                  async_scheduling=True)
        manager = llm.install("structured_outputs").manager
        manager.can_hand_off = hand_off
        try:
            results.append(_comparable(llm.generate(prompts[:8], params[:8], use_tqdm=False)))
            assert bool(manager.handoff) == hand_off
            assert not hand_off or manager.handoff.ticket > 1
            assert not hand_off or manager.handoff.on_device == torch.cuda.is_available()
        finally:
            llm.exit()
    assert_same(results[1], results[0])


def test_async_matches_sync_under_preemption():
    """A small cache (preemption, chunked prefill): the mixed workload gives the same outputs with
    async scheduling on and off, and its constrained outputs are valid. With async scheduling a
    constrained decode step whose tokens are in flight reads that step back while the device runs
    its forward, then fills its bitmask; with the handoff (the default on one rank) the fill runs in
    a thread and the sampler is launched at once (here on the CPU, which waits for the fill at the
    sampler's launch): the same outputs."""
    prompts, params = _mixed_workload()
    results, overlapped, handed_off = [], [], []
    for async_scheduling, hand_off in ((False, True), (True, True), (True, False)):
        llm = LLM("nanovllm:demo", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=14,
                  max_num_batched_tokens=48, max_model_len=224, async_scheduling=async_scheduling)
        manager = llm.install("structured_outputs").manager
        manager.can_hand_off = hand_off and async_scheduling
        original = manager._bitmask_handoff

        def spy_handoff(num_rows, mode=(async_scheduling, hand_off), original=original):
            # a constrained row's token was in flight: read back beside the forward
            overlapped.append(mode)
            found = original(num_rows)
            if found is not None:
                handed_off.append(mode)
            return found

        manager._bitmask_handoff = spy_handoff
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert_no_leaks(llm)
            assert llm.scheduler.num_preemptions > 0, (
                "the small cache should have forced preemption")
        finally:
            llm.exit()
        results.append(_comparable(outs))
        for out, sp in zip(outs, params):
            if sp.structured_outputs is not None and out.outputs[0].finish_reason == "stop":
                assert_valid(sp.structured_outputs.kind, out.outputs[0].text, SMALL_SCHEMA)
    for result in results[1:]:
        assert_same(result, results[0])
    assert set(overlapped) == {(True, True), (True, False)}
    assert set(handed_off) == {(True, True)}


# ---- errors --------------------------------------------------------------------------------------
def test_constraints_that_do_not_compile_are_refused_before_any_request(demo):
    bad = [({"json": {"type": "objectx"}},
            r"structured_outputs.json does not compile: Unsupported type \"objectx\""),
           ({"regex": "(a"}, "structured_outputs.regex does not compile: Regex parsing error"),
           ({"grammar": "root ::= foo"},
            'structured_outputs.grammar does not compile: .*Rule "foo" is not defined'),
           ({"grammar": 'start: "a"'},
            "structured_outputs.grammar must be xgrammar's EBNF .* Lark grammars are not")]
    for constraint, message in bad:
        params = [params_of("json"), constrained(**constraint)]
        with pytest.raises(ValueError, match=message):
            demo.generate(PROMPTS[:2], params, use_tqdm=False)
        assert demo.is_finished() and not demo.core.requests


# ---- what xgrammar would silently misread: refused by name, or rewritten -------------------------
# (schema, the keyword and path the refusal names): each one xgrammar's converter compiles as if it
# were absent
IGNORED_KEYWORDS = [
    ({"type": "object",
      "properties": {"tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     "'uniqueItems' at properties.tags"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}},
     "'contains' at the root"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
     "'required' naming 'b', which is not under 'properties', at the root"),
    ({"type": "array", "items": {"allOf": [
        {"type": "object", "properties": {"a": {}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {}}, "required": ["b"]}]}},
     "'allOf' of 2 schemas at items"),
    ({"type": "integer", "not": {"const": 3}}, "'not' at the root"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "'dependentRequired' at the root"),
    ({"$defs": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "$ref": "#/$defs/n"},
     "'oneOf' whose branches may overlap at \\$defs.n"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "'if' at the root"),
    ({"type": "object", "additionalProperties": {"$ref": "#/$defs/i", "maximum": 3},
      "$defs": {"i": {"type": "integer"}}},
     "'maximum' beside '\\$ref' at additionalProperties"),
    ({"type": "array", "prefixItems": [{"type": "integer", "enum": [1, 5], "minimum": 3}]},
     "'minimum' beside 'enum' at prefixItems.0"),
    ({"anyOf": [{"type": "string", "enum": ["a", 1]}, {"type": "null"}]},
     "'type' beside 'enum' at anyOf.0"),
    ({"type": "string", "format": "color"}, "'format': 'color' at the root"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2},
     "'maxLength' beside 'pattern' at the root"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' at the root"),
    ({"type": "object", "properties": {"a": {}}, "propertyNames": {"pattern": "^b"}},
     "'propertyNames' beside 'properties' at the root"),
    ({"type": "object", "properties": {"ab": {"type": "string"}},
      "patternProperties": {"^a": {"type": "integer"}}},
     "'patternProperties' beside 'properties' at the root"),
    ({"type": "object", "properties": {"s": {"maxLength": 3}}},
     "'maxLength' without 'type' at properties.s"),
    ({"$defs": {"a": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"},
     "'\\$ref' to '#x' at the root"),
]


@pytest.mark.parametrize("schema, named", IGNORED_KEYWORDS,
                         ids=[named.split("'")[1].strip("\\") for _, named in IGNORED_KEYWORDS])
def test_schema_keywords_xgrammar_ignores_are_refused_naming_keyword_and_path(schema, named):
    with pytest.raises(ValueError, match=f"^structured_outputs.json: {named} is not supported"):
        StructuredOutputsParams(json=schema)
    with pytest.raises(ValueError, match="is not supported"):
        StructuredOutputsParams(json=json.dumps(schema))


def test_an_ignored_keyword_is_refused_at_admission_before_any_request(demo):
    params = constrained(json={"type": "array", "items": {"type": "integer"}, "maxItems": 3})
    # assigned after construction: checked again at admission
    params.structured_outputs.json["uniqueItems"] = True
    with pytest.raises(ValueError, match="'uniqueItems' at the root is not supported"):
        demo.generate(PROMPTS[:2], [params_of("json"), params], use_tqdm=False)
    assert demo.is_finished() and not demo.core.requests


def test_one_of_is_kept_only_where_no_value_can_match_two_branches():
    """xgrammar compiles ``oneOf`` as ``anyOf``, exact where the branches are disjoint: distinct
    consts or enums, distinct types, or objects told apart by a required const (through ``$ref``, as
    pydantic writes them)."""
    tagged = {"$defs": {k: {"type": "object",
                            "properties": {"kind": {"const": k}, "n": {"type": "integer"}},
                            "required": ["kind", "n"]} for k in ("cat", "dog")},
              "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
              "discriminator": {"propertyName": "kind"}}
    for schema in ({"oneOf": [{"const": 1}, {"enum": [2, "1"]}]},
                   {"oneOf": [{"type": "string"}, {"type": "integer"}]}, tagged):
        assert StructuredOutputsParams(json=schema).kind == "json"
    same_tag = json.loads(json.dumps(tagged).replace('"const": "dog"', '"const": "cat"'))
    for schema in ({"oneOf": [{"enum": [1, 2]}, {"enum": [2, 3]}]},
                   {"oneOf": [{"const": 1}, {"const": 1.0}]},
                   {"oneOf": [{"type": "integer"}, {"type": "number"}]}, same_tag):
        with pytest.raises(ValueError, match="'oneOf' whose branches may overlap"):
            StructuredOutputsParams(json=schema)


def test_schemas_xgrammar_enforces_are_still_accepted(demo):
    schemas = [SCHEMA, SMALL_SCHEMA, {"type": "string", "enum": ["a", "b"]},
               {"type": "integer", "multipleOf": 3},
               {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "x"},
               {"type": "object", "additionalProperties": {"type": "integer"},
                "propertyNames": {"pattern": "^a"}},
               {"type": "string", "format": "date"},
               {"type": "array", "uniqueItems": False, "maxItems": 2}]
    for schema in schemas:
        demo.install("structured_outputs").manager.compile(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("schema", [{"type": "string", "minLength": 2, "maxLength": 8},
                                    {"type": ["string", "null"], "minLength": 2, "maxLength": 8},
                                    {"type": "object",
                                     "propertyNames": {"minLength": 2, "maxLength": 8},
                                     "additionalProperties": {"type": "integer"}}],
                         ids=["string", "typelist", "names"])
def test_length_limited_strings_admit_only_json_legal_characters(demo, schema):
    """xgrammar's grammar for a length-limited string admits raw control characters; ours is a
    pattern of JSON's raw characters, each counted once."""
    import xgrammar as xgr
    wrap = (lambda s: f"{{{s}: 1}}") if "propertyNames" in schema else (lambda s: s)
    compiled = demo.install("structured_outputs").manager.compile(
        StructuredOutputsParams(json=schema))
    for text, legal in (('"a\x01b"', False), ('"a\nb"', False), ('"a\tb"', False), ('"ab"', True),
                        ('"é😀"', True), ('"abcdefgh"', True), ('"abcdefghi"', False),
                        ('"a"', False)):
        assert xgr.GrammarMatcher(compiled).accept_string(wrap(text)) is legal, text


def test_sampled_length_limited_strings_parse_and_validate(tiny):
    """The random byte-level model samples control characters and invalid UTF-8 wherever the grammar
    lets it."""
    schema = {"type": "string", "minLength": 2, "maxLength": 8}
    llm = LLM(tiny, **ENGINE)
    try:
        params = constrained(max_tokens=24, temperature=1.0, sampling={"n": 8}, json=schema)
        outs = llm.generate([[5, 6, 7], [100, 101], [42] * 9, [250, 3, 17, 99]], params,
                            use_tqdm=False)
    finally:
        llm.exit()
    stopped = [c.text for out in outs for c in out.outputs if c.finish_reason == "stop"]
    assert len(stopped) >= 16
    for text in stopped:
        # json.loads is strict: no raw control character
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("regex, named", [
    (r"abc\Z", r"'\\\\Z' at position 3"), (r"\Aab", r"'\\\\A' at position 0"),
    (r"\Gab", r"'\\\\G' at position 0"),
    (r"a$b", "'\\$' at position 1 is not supported .only at the end"),
    (r"a|^b", "'\\^' at position 2"),
    (r"[\^a]b", r"'\\\\\^' first in a character class at position 1"),
    (r"\x{41}", r"'\\\\x' at position 0"), (r"[\Z]", r"'\\\\Z' at position 1")])
def test_regex_syntax_xgrammar_misreads_is_refused_by_name(regex, named):
    with pytest.raises(ValueError, match=f"^structured_outputs.regex: {named}"):
        StructuredOutputsParams(regex=regex)


def test_regex_syntax_xgrammar_reads_right_is_accepted_and_the_rest_refused_at_admission(demo):
    for regex in (r"^\d{3}-\d{4}$", r"a\$b[$^]", r"[a\^]\x41\u0041[\b]\.", r"(?:ab|c)*?d\s\w"):
        demo.install("structured_outputs").manager.compile(StructuredOutputsParams(regex=regex))
    for regex, reason in ((r"\bab", "Word boundary"), (r"(a)\1", "Backreference"),
                          (r"(?i)ab", "Group modifier"), ("a++", "Two consecutive repetition"),
                          ("(?<=a)b", "Lookbehind")):
        with pytest.raises(ValueError,
                           match=f"structured_outputs.regex does not compile: .*{reason}"):
            demo.generate(PROMPTS[:1], constrained(regex=regex), use_tqdm=False)
    assert demo.is_finished() and not demo.core.requests


def test_a_constraint_that_matches_nothing_is_refused_at_admission(demo):
    for regex in (r"[^\s\S]", r"ab|c[^\d\D]"):
        with pytest.raises(ValueError, match=r"structured_outputs.regex matches no string: "
                                             r"'\[\^.*' at position"):
            StructuredOutputsParams(regex=regex)
    for constraint in ({"regex": r"[^\u0000-\uffff\u{10000}-\u{10ffff}]"},
                       {"grammar": r"root ::= [^\0-\U0010FFFF]"}):
        with pytest.raises(ValueError,
                           match=f"structured_outputs.{next(iter(constraint))} matches no string"):
            demo.generate(PROMPTS[:2], [params_of("json"), constrained(**constraint)],
                          use_tqdm=False)
        assert demo.is_finished() and not demo.core.requests


def test_schemas_nested_too_deep_are_refused_naming_the_limit():
    def nested(depth):
        schema = {"type": "integer"}
        for _ in range(depth):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return schema
    assert StructuredOutputsParams(json=nested(60)).kind == "json"
    deep_text = '{"properties": {"a": ' * 2000 + "{}" + "}}" * 2000
    deep_enum = '{"enum": [' + "[" * 2000 + "]" * 2000 + "]}"
    for schema in (nested(65), nested(300), nested(2000), deep_text, deep_enum):
        with pytest.raises(ValueError,
                           match="structured_outputs.json is nested more than 64 levels deep"):
            StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_refused_token_ends_that_request_alone(demo, async_scheduling):
    """A token the grammar refuses (never sampled under its mask; forced here) ends that completion
    with finish_reason "error", naming why; its neighbour goes on. With async scheduling the next
    bitmask is filled before the stop checks (the deferred sampler): the refused row is left out of
    it."""
    if async_scheduling:
        demo = LLM("nanovllm:demo", dtype="float32", num_kvcache_blocks=64, kvcache_block_size=16,
                   async_scheduling=True)
    bad = demo.add_request("config = ", json_params())
    good = demo.add_request("config = ", json_params())
    manager = demo.install("structured_outputs").manager
    accept = manager.accept

    def refuse_bad(advanced):  # the real accepts, then the bad request's token refused
        refused = accept(advanced)
        refused.update({seq: RuntimeError(f"the grammar refused token {t}") for seq, t in advanced
                        if seq is bad.seqs[0]})
        return refused

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manager, "accept", refuse_bad)
        while demo.has_unfinished_requests():
            demo.step()
    assert bad.seqs[0].finish_reason == "error" and "the grammar refused token" in bad.error
    assert good.seqs[0].finish_reason == "stop"
    assert_no_leaks(demo)
    assert not manager.matchers, "an ended sequence's matcher was kept"
    if async_scheduling:
        assert manager.handoff and manager.handoff.ticket > 0  # the handoff's path was taken
        demo.exit()


def test_compiled_grammars_are_cached(demo):
    manager = demo.install("structured_outputs").manager
    a = manager.compile(StructuredOutputsParams(json=SCHEMA))
    # an equal schema
    assert manager.compile(StructuredOutputsParams(json=json.loads(json.dumps(SCHEMA)))) is a
    assert manager.compile(StructuredOutputsParams(json=json.dumps(SCHEMA))) is a
    assert manager.compile(StructuredOutputsParams(json=SCHEMA,
                                                   disable_any_whitespace=True)) is not a
    assert manager.compile(StructuredOutputsParams(choice=["a", "b"])) is \
        manager.compile(StructuredOutputsParams(grammar=choice_grammar(["a", "b"])))


def test_grammar_cache_is_bounded_in_bytes(demo, monkeypatch):
    """Least recently used grammars go once the cache holds more than CACHE_BYTES (the newest always
    stays)."""
    from nanovllm.features import structured_output
    manager = StructuredOutputManager(demo.tokenizer, 4096, (0,))
    first = manager.compile(StructuredOutputsParams(regex="a+"))
    one = first.memory_size_bytes
    monkeypatch.setattr(structured_output, "CACHE_BYTES", int(2.5 * one))
    for pattern in ("b+", "c+", "d+"):
        manager.compile(StructuredOutputsParams(regex=pattern))
    assert [key[1] for key in manager.cache] == ["c+", "d+"] and manager.cache_bytes <= 2.5 * one
    assert manager.compile(StructuredOutputsParams(regex="a+")) is not first  # compiled again


def test_missing_xgrammar_and_tokenizer_are_named(demo, monkeypatch):
    manager = StructuredOutputManager(demo.tokenizer, 4096, (0,))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails, as without the extra
    with pytest.raises(ValueError, match=r"needs xgrammar, nanovllm's optional extra: pip install "
                                         r"-e '.\[structured"):
        manager.compile(StructuredOutputsParams(regex="a"))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="need a tokenizer"):
        StructuredOutputManager(None, 4096, (0,)).compile(StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="need an EOS token"):
        StructuredOutputManager(demo.tokenizer, 4096, ()).compile(
            StructuredOutputsParams(regex="a"))


# ---- a tiny random checkpoint: a model vocabulary larger than the tokenizer's, TP=2 --------------
def test_tiny_checkpoint_never_samples_past_the_tokenizer(tiny):
    """The random model puts mass on ids 259..319, which no tokenizer token stands for: under a
    constraint none is ever sampled, and what ends by EOS is valid."""
    prompts = [[5, 6, 7], [100, 101], [42] * 9, [250, 3, 17, 99]]
    params = [constrained(60, 1.0, json=SCHEMA),  # any whitespace (vLLM's)
              constrained(40, 1.0, regex=REGEX), constrained(20, 1.0, choice=CHOICES),
              constrained(40, 0.0, grammar=EBNF)]
    llm = LLM(tiny, **ENGINE)
    try:
        free = llm.generate(prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=60),
                            use_tqdm=False)
        # what an unconstrained run samples
        assert any(t >= 259 for o in free for t in o.outputs[0].token_ids)
        outs = llm.generate(prompts * 3, params * 3, use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        llm.exit()
    for out, sp in zip(outs, params * 3):
        c = out.outputs[0]
        assert all(t <= 256 for t in c.token_ids), c.token_ids  # bytes, or EOS (256)
        if c.finish_reason == "stop":
            assert_valid(sp.structured_outputs.kind, c.text)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)


def test_tensor_parallel_2_gives_the_single_rank_outputs(tiny):
    prompts = [[5, 6, 7], [100, 101], [42] * 9, [250, 3, 17, 99]]
    params = [constrained(40, 0.0, regex=REGEX), SamplingParams(temperature=0, max_tokens=30),
              constrained(30, 0.9, json=SCHEMA, disable_any_whitespace=True),
              constrained(20, 0.0, choice=CHOICES)]
    results = []
    for tp in (1, 2):
        llm = LLM(tiny, **CPU_ENGINE, tensor_parallel_size=tp, async_scheduling=True)
        try:
            results.append(_comparable(llm.generate(prompts, params, use_tqdm=False)))
        finally:
            llm.exit()
    assert_same(results[1], results[0])


def test_tensor_parallel_exit_after_an_abort_is_prompt():
    """TP=2, async: a constrained request aborted part-way, then the engine left. The workers hear
    exit() and end cleanly, not killed after the join timeout (a worker waits in the sampler's
    broadcast until rank 0 samples: a sampler rank 0 held back across steps once left it there)."""
    import time
    llm = LLM("nanovllm:demo", device="cpu", dtype="float32", kvcache_block_size=16,
              num_kvcache_blocks=64, max_model_len=224, async_scheduling=True,
              tensor_parallel_size=2)
    try:
        request = llm.add_request("config = ", constrained(60, 0.0, regex=r"[a-z]{20,40}"))
        for _ in range(5):
            llm.step()
        llm.abort_request(request)
        processes = llm.workers.processes
    finally:
        start = time.perf_counter()
        llm.exit()
    assert time.perf_counter() - start < 4.0   # the join timeout is 5 s
    assert [p.exitcode for p in processes] == [0]


@pytest.mark.gpu
def test_cuda_graphs_bf16_and_the_fast_sampler(monkeypatch):
    """The demo model on CUDA as it runs by default (bf16, CUDA Graphs, async scheduling):
    constrained requests of temperatures only (the Triton sampler over masked logits) beside free
    ones give valid outputs, their bitmasks filled while the device runs the forward; float32 async
    matches sync."""
    prompts, params = _mixed_workload()
    # temperatures only, free requests too: the whole batch is plain, so it takes the Triton sampler
    plain = [SamplingParams(temperature=sp.temperature, max_tokens=sp.max_tokens,
                            structured_outputs=sp.structured_outputs) for sp in params]
    from nanovllm.layers.sampler import _triton_sampler
    fast, masked_batches = _triton_sampler(), []
    original_sample = fast.sample
    monkeypatch.setattr(fast, "sample", lambda logits, t, seed: masked_batches.append(
        bool(torch.isinf(logits).any())) or original_sample(logits, t, seed))
    llm = LLM("nanovllm:demo", num_kvcache_blocks=64, kvcache_block_size=16)
    splits, manager = [], llm.install("structured_outputs").manager
    original = manager._bitmask_handoff
    manager._bitmask_handoff = lambda num_rows: splits.append(1) or original(num_rows)
    try:
        assert llm.config.async_scheduling and not llm.config.enforce_eager
        outs = llm.generate(prompts, plain, use_tqdm=False)
        assert_no_leaks(llm)
        assert manager.handoff and manager.handoff.on_device, (
            "the device did not wait for the bitmasks itself")
    finally:
        llm.exit()
    assert splits, "no bitmask was filled while a step was in flight"
    assert any(masked_batches), "no masked batch took the Triton sampler"
    for out, sp in zip(outs, plain):
        if sp.structured_outputs is not None:
            assert out.outputs[0].finish_reason in ("stop", "length")
            if out.outputs[0].finish_reason == "stop":
                assert_valid(sp.structured_outputs.kind, out.outputs[0].text, SMALL_SCHEMA)
    results = []
    for mode in (False, True):
        llm = LLM("nanovllm:demo", dtype="float32", num_kvcache_blocks=64, kvcache_block_size=16,
                  async_scheduling=mode)
        try:
            results.append(_comparable(llm.generate(prompts, params, use_tqdm=False)))
        finally:
            llm.exit()
    assert_same(results[1], results[0])


def test_bitmask_rows_filled_by_xgrammars_batch_matcher_are_those_of_one_thread(demo):
    """fill_rows on several threads (xgrammar's BatchGrammarMatcher) fills the same bits as one
    thread filling every row, into the rows named, leaving the others."""
    from nanovllm.features import structured_output
    manager = StructuredOutputManager(demo.tokenizer, 4096, (0,))
    compiled = manager.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}))
    xgr = structured_output.import_xgrammar()
    prefixes = ['', '{', '{"name"', '{"name": "ab', '{"name": "ab", ', '{"name": "x", "n": 1',
                '{"name": "x", "n"']
    rows = []
    for i in range(20):
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(prefixes[i % len(prefixes)])
        rows.append((2 * i + 1, matcher))   # odd rows only: the even ones must stay as they were
    shape = xgr.get_bitmask_shape(40, 4096)
    alone, batched = (torch.full(shape, -1, dtype=torch.int32),
                      torch.full(shape, 7, dtype=torch.int32))
    structured_output.fill_rows(rows, alone, threads=1)
    structured_output.fill_rows(rows, batched, threads=4)
    assert torch.equal(alone[1::2], batched[1::2])
    assert (batched[0::2] == 7).all()
    assert len({tuple(row.tolist()) for row in alone[1::2]}) >= 4


def test_accept_advances_each_matcher(demo):
    """The tokens a matcher takes advance it (num_accepted counts them); a refused one is an error
    naming it for that sequence alone; the matchers end where one-by-one accepts leave them."""
    from nanovllm.features import structured_output
    manager = StructuredOutputManager(demo.tokenizer, 4096, (0,))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    tok = demo.tokenizer
    y, n, q = tok.encode("y")[0], tok.encode("n")[0], tok.encode("q")[0]
    seqs = [Sequence([1]) for _ in range(3)]
    manager.add(seqs, params)
    refused = manager.accept(list(zip(seqs, [y, q, n])))
    assert list(refused) == [seqs[1]] and f"refused token {q} after 0" in str(refused[seqs[1]])
    assert [manager.matchers[seq.seq_id].num_accepted for seq in seqs] == [1, 0, 1]
    one = [Sequence([1])]
    manager.add(one, params)
    assert manager.matchers[one[0].seq_id].matcher.accept_token(y)
    shape = structured_output.import_xgrammar().get_bitmask_shape(2, 4096)
    a, b = torch.zeros(shape, dtype=torch.int32), torch.zeros(shape, dtype=torch.int32)
    manager.matchers[seqs[0].seq_id].matcher.fill_next_token_bitmask(a, 0)
    manager.matchers[one[0].seq_id].matcher.fill_next_token_bitmask(b, 0)
    assert torch.equal(a, b) and manager.accept([]) == {}
    manager.forget(seqs[0])
    assert seqs[0].seq_id not in manager.matchers


def test_a_constrained_generate_on_a_thread_the_main_thread_left_behind():
    """With async scheduling (the deferred sampler's fill in a background thread), a generate()
    running on a non-daemon thread when the main thread ends still finishes: past that point
    concurrent.futures refuses new work, so the fill is done in the engine's thread. (It failed the
    engine with "cannot schedule new futures after interpreter shutdown".)"""
    import subprocess
    script = f"""
import sys, threading
sys.path.insert(0, {repr(os.path.dirname(os.path.abspath(__file__)))})
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from test_structured_output import SMALL_SCHEMA
llm = LLM("nanovllm:demo", dtype="float32", num_kvcache_blocks=64, kvcache_block_size=16,
          async_scheduling=True)
sp = SamplingParams(temperature=0, max_tokens=40,
                    structured_outputs=StructuredOutputsParams(json=SMALL_SCHEMA,
                                                               disable_any_whitespace=True))
def work():
    outs = llm.generate(["config = "] * 4, sp, use_tqdm=False)
    print("DONE", [o.outputs[0].finish_reason for o in outs], flush=True)
threading.Thread(target=work).start()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DONE ['stop', 'stop', 'stop', 'stop']" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_exit_lets_go_of_a_device_wait_for_a_bitmask():
    """exit() with a constrained step in flight whose bitmask is still being handed over (the
    add_request/step API stopped mid-way): the handoff's flag is opened, so that no wait on the
    device for a fill outlives the engine."""
    llm = LLM("nanovllm:demo", dtype="float32", num_kvcache_blocks=64, kvcache_block_size=16,
              async_scheduling=True)
    try:
        llm.add_request("config = ", json_params(max_tokens=40))
        for _ in range(20):
            llm.step()
            if llm.core.inflight is not None and llm.core.inflight[1].host_work:
                break
        assert llm.core.inflight[1].host_work
        handoff = llm.install("structured_outputs").manager.handoff
        assert handoff._flag[0] < BitmaskHandoff.OPEN
    finally:
        llm.exit()
    assert handoff._flag[0] == BitmaskHandoff.OPEN


def test_bitmask_handoff_tickets_and_its_wait_on_the_cpu():
    """A handoff's buffer has a row of ceil(V / 32) words a sequence; tickets count up, the flag
    never goes back (a late publish after a later one, or after open()), and on the CPU the
    sampler's bitmask is the fill's, once it is done."""
    import threading
    from concurrent.futures import Future
    handoff = BitmaskHandoff(4, 100, torch.device("cpu"))
    assert handoff.host.shape == (4, 4) and handoff.rows is None
    first, second = handoff.reserve(), handoff.reserve()
    assert (first, second) == (1, 2)
    handoff.publish(second)
    handoff.publish(first)
    assert handoff._flag[0] == 2
    fill = Future()
    threading.Timer(0.05, lambda: fill.set_result(handoff.host[:3].fill_(7))).start()
    got = handoff.to_device(second, 3, fill)
    assert got.data_ptr() == handoff.host.data_ptr() and bool((got == 7).all())
    handoff.open()
    handoff.publish(3)
    assert handoff._flag[0] == BitmaskHandoff.OPEN
    # as the device writes it, were it a device: the CPU's sampler never waits on a flag
    handoff.gave_up[0] = 2
    PendingFill(Future(), handoff, 2).check()


def test_a_device_wait_that_gave_up_is_an_error_at_the_read_back():
    """A step whose device wait for its bitmask gave up (the device's gave_up word at its ticket) is
    not read back as if its tokens were constrained: PendingFill.check raises, after the fill's own
    wait."""
    from concurrent.futures import Future
    handoff = BitmaskHandoff(2, 64, torch.device("cpu"))
    handoff.on_device = True  # the check alone, as on CUDA; nothing is launched here
    fill = Future()
    fill.set_result(None)
    handed = PendingFill(fill, handoff, handoff.reserve())
    handed.wait()
    handed.check()  # the device waited (gave_up below the ticket)
    handoff.gave_up[0] = handed.ticket
    with pytest.raises(RuntimeError, match="stopped waiting for a structured-output bitmask"):
        handed.check()


def test_a_failed_fill_still_raises_the_flag():
    """The fill's done() (the handoff's publish) is called when the fill fails too, so the device
    never waits for a fill that ended; the error reaches the caller through the Future."""
    class Broken:
        def fill_next_token_bitmask(self, bitmask, row):
            raise RuntimeError("broken matcher")

    manager = StructuredOutputManager(None, 64, (0,))
    done = []
    with pytest.raises(RuntimeError, match="broken matcher"):
        manager._fill(torch.empty(2, 2, dtype=torch.int32), [(0, Broken())],
                      lambda: done.append(True))
    assert done == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_device_waits_for_the_bitmask_the_host_writes_after_the_launch():
    """On CUDA the wait and the copy are launched before the host has written the bitmask
    (BitmaskHandoff): what reaches the device is what the host wrote, later, in another thread,
    before it raised the flag."""
    import threading
    import time
    handoff = BitmaskHandoff.create(8, 1000, torch.device("cuda"))
    assert handoff is not None and handoff.on_device
    for rows in (1, 8):
        ticket = handoff.reserve()
        handoff.host.zero_()
        got = handoff.to_device(ticket, rows, None)
        expected = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, handoff.host.size(1)),
                                 dtype=torch.int32)

        def write(rows=rows, expected=expected, ticket=ticket):
            time.sleep(0.2)
            handoff.host[:rows].copy_(expected)
            handoff.publish(ticket)

        writer = threading.Thread(target=write)
        writer.start()
        torch.cuda.synchronize()
        writer.join()
        assert torch.equal(got.cpu(), expected)
