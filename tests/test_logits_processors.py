"""vLLM v1's logits processors (``LLM(logits_processors=[...])``: batch-level classes and the
per-request adapter) and the built-in ``allowed_token_ids`` and ``bad_words``, on CPU with async
scheduling on and off."""
from __future__ import annotations

import re

import pytest
import torch
from conftest import CPU_ENGINE

from nanovllm import LLM, SamplingParams
from nanovllm.config import VllmConfig
from nanovllm.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    bad_words_token_ids,
    process_dict_updates,
)

# prompts of different lengths, prefilled in chunks of a small budget beside running decodes, ending
# at different steps: the batch changes make-up and order from step to step
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21],
           [30, 31, 32, 33]]
MAX_TOKENS = [8, 5, 8, 3, 6]
LETTERS = list(range(ord("a"), ord("z") + 1))  # the byte tokenizer's ids of a-z


class DummyLogitsProcessor(LogitsProcessor):
    """vLLM's example processor: masks all but ``extra_args["target_token"]`` for the requests that
    ask."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _, __: (params.extra_args
                                                    and params.extra_args.get("target_token")))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        rows = torch.tensor(list(self.req_info.keys()), dtype=torch.long, device=logits.device)
        values_to_keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = values_to_keep
        return logits


class CountingProcessor(AdapterLogitsProcessor):
    """Per-request form: forces ``extra_args["count_from"]`` plus the number of tokens generated so
    far (reads the live output list), or the prompt's first token plus that number with
    ``"from_prompt"``."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        if "from_prompt" in args:
            return lambda prompt_ids, output_ids, row: force(row, prompt_ids[0] + len(output_ids))
        if "count_from" in args:
            return lambda output_ids, row: force(row, args["count_from"] + len(output_ids))
        return None


def force(row: torch.Tensor, token: int) -> torch.Tensor:
    out = torch.full_like(row, float("-inf"))
    out[token] = row[token]
    return out


class CheckedDummy(DummyLogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params):
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and not isinstance(target, int):
            raise ValueError(f"extra_args['target_token'] must be an int, got {target!r}")


def generate(llm, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def mixed(extra: list[dict | None]) -> list[SamplingParams]:
    """Greedy and seeded sampled requests, alternately."""
    return [SamplingParams(temperature=0 if i % 2 == 0 else 1.0, seed=None if i % 2 == 0 else i,
                           max_tokens=m, ignore_eos=True, extra_args=e)
            for i, (m, e) in enumerate(zip(MAX_TOKENS, extra))]


def engine(tiny, processors=(), **kw) -> LLM:
    return LLM(tiny, **{**CPU_ENGINE, "max_num_batched_tokens": 8, **kw},
               logits_processors=list(processors))


@pytest.fixture(scope="module")
def unprocessed(tiny):
    llm = engine(tiny)
    yield llm
    llm.exit()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_dummy_processor_forces_its_target_only_for_requests_that_ask(tiny, unprocessed,
                                                                       async_scheduling):
    extra = [{"target_token": 97}, None, {"target_token": 42}, None, {"target_token": 250}]
    plain = generate(unprocessed, mixed(extra))
    llm = engine(tiny, [DummyLogitsProcessor], async_scheduling=async_scheduling)
    try:
        got = generate(llm, mixed(extra))
    finally:
        llm.exit()
    for i, e in enumerate(extra):
        assert got[i] == ([e["target_token"]] * MAX_TOKENS[i] if e else plain[i]), i


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_per_request_processors_see_every_generated_token(tiny, unprocessed, async_scheduling):
    extra = [{"count_from": 100}, {"from_prompt": True}, None, {"count_from": 7},
             {"from_prompt": True}]
    plain = generate(unprocessed, mixed(extra))
    llm = engine(tiny, [CountingProcessor], async_scheduling=async_scheduling)
    try:
        got = generate(llm, mixed(extra))
    finally:
        llm.exit()
    for i, e in enumerate(extra):
        start = PROMPTS[i][0] if e and "from_prompt" in e else (e or {}).get("count_from")
        assert got[i] == (list(range(start, start + MAX_TOKENS[i])) if start is not None
                          else plain[i]), i


def test_allowed_token_ids_bound_every_sampled_token(unprocessed):
    params = [SamplingParams(temperature=t, seed=1, max_tokens=12, ignore_eos=True,
                             allowed_token_ids=LETTERS)
              for t in (0, 1.5, 5.0)] + [SamplingParams(temperature=0, max_tokens=12,
                                                        ignore_eos=True, allowed_token_ids=[200])]
    outputs = unprocessed.generate(PROMPTS[:4], params, use_tqdm=False)
    assert all(t in LETTERS for o in outputs[:3] for t in o.outputs[0].token_ids)
    assert outputs[3].outputs[0].token_ids == [200] * 12
    # sampled rows still sample
    assert len({tuple(o.outputs[0].token_ids) for o in outputs[:3]}) > 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_are_never_completed(tiny, async_scheduling):
    llm = engine(tiny, async_scheduling=async_scheduling)
    sp = dict(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=LETTERS)
    try:
        base = llm.generate([PROMPTS[0]], SamplingParams(**sp),
                            use_tqdm=False)[0].outputs[0].token_ids
        pair, single = chr(base[1]) + chr(base[2]), chr(base[0])
        # seeds 0 and 1
        sampled = SamplingParams(**{**sp, "temperature": 1.0}, n=2, seed=0, bad_words=[single])
        out = llm.generate([PROMPTS[0]] * 3, [SamplingParams(**sp, bad_words=[pair]),
                                              SamplingParams(**sp, bad_words=[single, "zz"]),
                                              sampled], use_tqdm=False)
    finally:
        llm.exit()
    with_pair, with_single = (o.outputs[0].token_ids for o in out[:2])
    assert all(base[0] not in c.token_ids for c in out[2].outputs)
    first = next(j for j in range(1, len(base)) if (base[j - 1], base[j]) == (base[1], base[2]))
    # banned after the pair's start
    assert with_pair[:first] == base[:first] and with_pair[first] != base[first]
    assert all((a, b) != (base[1], base[2]) for a, b in zip(with_pair, with_pair[1:]))
    assert base[0] not in with_single and base[0] in base
    assert all((a, b) != (ord("z"), ord("z")) for a, b in zip(with_single, with_single[1:]))


def test_bad_words_tokenize_as_vllm_does_with_and_without_a_leading_space():
    class Tokenizer:
        ids = {"foo": [1, 2], " foo": [3, 2], "bar": [4], " bar": [5, 6], "x": [7], " x": [7],
               "": [], " ": [8]}

        def encode(self, text, add_special_tokens):
            assert add_special_tokens is False
            return self.ids[text]

    assert bad_words_token_ids(["foo", " bar", "x"], Tokenizer()) == [[1, 2], [3, 2], [4], [7]]
    with pytest.raises(ValueError, match="bad_words entries must tokenize to at least one token"):
        bad_words_token_ids(["foo", " "], Tokenizer())


def test_validate_params_refuses_at_admission_before_any_request_runs(tiny):
    llm = engine(tiny, [CheckedDummy])
    try:
        good = SamplingParams(temperature=0, max_tokens=2, extra_args={"target_token": 5})
        with pytest.raises(ValueError,
                           match=r"extra_args\['target_token'\] must be an int, got '5'"):
            llm.generate(PROMPTS[:2], [good, SamplingParams(extra_args={"target_token": "5"})],
                         use_tqdm=False)
        assert llm.is_finished() and not llm.requests
        assert llm.generate(PROMPTS[:1], good, use_tqdm=False)[0].outputs[0].token_ids == [5, 5]
    finally:
        llm.exit()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(allowed_token_ids=[]), ValueError,
     r"allowed_token_ids is not None and empty! .*got \[\]"),
    (dict(allowed_token_ids=[1, -2]), ValueError,
     r"allowed_token_ids must be a list of non-negative ints"),
    (dict(allowed_token_ids="abc"), ValueError,
     r"allowed_token_ids must be a list of non-negative ints"),
    (dict(bad_words="abc"), TypeError, r"bad_words must be a list of strings, got 'abc'"),
    (dict(bad_words=["ok", ""]), ValueError, r"bad_words cannot contain an empty string"),
    (dict(extra_args=[("k", 1)]), TypeError, r"extra_args must be a dict, got \[\('k', 1\)\]"),
])
def test_bad_processor_fields_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_out_of_vocabulary_allowed_ids_and_untokenizable_bad_words_are_refused_at_admission(
        unprocessed):
    with pytest.raises(ValueError,
                       match=r"allowed_token_ids contains out-of-vocab token ids \[320\]"):
        unprocessed.generate(PROMPTS[:1], SamplingParams(allowed_token_ids=[3, 320]),
                             use_tqdm=False)
    with pytest.raises(ValueError,
                       match="bad_words entries must tokenize to at least one token, got ' '"):
        unprocessed.generate(PROMPTS[:1], SamplingParams(bad_words=[" "]), use_tqdm=False)
    assert unprocessed.is_finished() and not unprocessed.requests


class Abstract(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        pass


@pytest.mark.parametrize("entry, error, match", [
    (DummyLogitsProcessor(None, None, False), TypeError,
     "is not a subclass of nanovllm.logits_processor"),
    (dict, TypeError,
     "<class 'dict'> is not a subclass of nanovllm.logits_processor.LogitsProcessor"),
    (Abstract, TypeError, "Abstract'> does not implement apply, is_argmax_invariant, update_state"),
    ("no_such_module.Processor", ValueError, "'no_such_module.Processor' cannot be imported"),
    ("test_logits_processors:Missing", ValueError,
     "'test_logits_processors:Missing' cannot be imported"),
    ("collections.OrderedDict", TypeError, "'collections.OrderedDict' is not a subclass"),
])
def test_bad_logits_processor_classes_are_refused_by_name(tiny, entry, error, match):
    with pytest.raises(error, match=match):
        LLM(tiny, **CPU_ENGINE, logits_processors=[entry])


def test_logits_processors_by_name_and_not_a_list(tiny):
    from nanovllm.logits_processor import load_logits_processors
    names = ["test_logits_processors.DummyLogitsProcessor",
             "test_logits_processors:CountingProcessor"]
    assert load_logits_processors(names) == [DummyLogitsProcessor, CountingProcessor]
    with LLM(tiny, **CPU_ENGINE, logits_processors=names) as llm:  # the feature takes the names
        assert llm.features["logits_processors"].classes == [DummyLogitsProcessor,
                                                             CountingProcessor]
    # none: the feature is not installed
    with LLM(tiny, **CPU_ENGINE, logits_processors=None) as llm:
        assert "logits_processors" not in llm.features
    with pytest.raises(TypeError,
                       match="logits_processors must be a list of LogitsProcessor classes"):
        LLM(tiny, **CPU_ENGINE, logits_processors=DummyLogitsProcessor)


def test_a_processor_class_that_cannot_pickle_runs_under_tensor_parallelism(tiny):
    """Rank 0 alone samples: a class defined in a function (which cannot be pickled to the workers)
    still works with two ranks."""

    class LocalDummy(DummyLogitsProcessor):
        pass

    llm = LLM(tiny, tensor_parallel_size=2, logits_processors=[LocalDummy], **CPU_ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                extra_args={"target_token": 42})
        out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]
    finally:
        llm.exit()
    assert out.outputs[0].token_ids == [42] * 4


class OneRow(DummyLogitsProcessor):
    """While a request asks for a target, returns a single row: broadcast, it gave every request
    one prompt's tokens."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[0] if self.req_info else logits


class ReturnsNone(DummyLogitsProcessor):
    def apply(self, logits: torch.Tensor):
        return None if self.req_info else logits


class Raises(DummyLogitsProcessor):
    def apply(self, logits: torch.Tensor):
        if self.req_info:
            raise KeyError("no such row")
        return logits


@pytest.mark.parametrize("cls, error", [
    (OneRow, r"ValueError: .*apply must return the logits' shape \(\d+, \d+\), "
             r"got a tensor of shape \(\d+,\)"),
    (ReturnsNone, r"ValueError: .*apply must return the logits' shape \(\d+, \d+\), got None"),
    (Raises, r"RuntimeError: .*apply raised KeyError: 'no such row'")])
def test_a_failing_processor_ends_its_steps_requests_by_name_and_the_engine_serves_on(
        tiny, unprocessed, cls, error):
    """The step's requests end with "error" naming the processor and what it did (never tokens
    of another request); later requests finish, each with its own tokens."""
    llm = engine(tiny, [cls])
    try:
        boom = SamplingParams(temperature=0, max_tokens=3, extra_args={"target_token": 42})
        outs = llm.generate(PROMPTS[:2], boom, use_tqdm=False)
        for out in outs:
            assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
            assert re.fullmatch(error.replace(".*", rf"logits processor {cls.__qualname__}\."),
                                out.error)
        params = mixed([None] * len(PROMPTS))
        assert generate(llm, params) == generate(unprocessed, params)
    finally:
        llm.exit()


def test_vllms_module_paths_of_the_interface_and_the_logger():
    from nanovllm.logger import init_logger
    from nanovllm.v1.sample.logits_processor import BatchUpdate as B
    from nanovllm.v1.sample.logits_processor import LogitsProcessor as L
    assert L is LogitsProcessor and B is BatchUpdate
    assert init_logger("vllm").name == "nanovllm" and init_logger("x").name == "nanovllm.x"
