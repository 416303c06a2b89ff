"""The engine used as new users use it: parameters set after construction, engines dropped or used as
context managers, chat keywords, hostile values, prefix-sharing admission, streams left early, nested
and interleaved calls, threads."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
from conftest import ENGINE, assert_no_leaks, random_prompts

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _ids(outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


# ---- SamplingParams fields assigned after construction -----------------------------------------
def test_assigned_fields_are_honoured(llm):
    prompts = random_prompts(4, 5, 30, seed=70)
    greedy = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))

    top_k = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    top_k.top_k = 1  # as vLLM's own examples do: sp = llm.get_default_sampling_params(); sp.top_k = ...
    assert _ids(llm.generate(prompts, top_k, use_tqdm=False)) == greedy

    seeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    seeded.seed = 7
    first = _ids(llm.generate(prompts, seeded, use_tqdm=False))
    llm.generate(random_prompts(3, 5, 9, seed=71), SamplingParams(temperature=1.0), use_tqdm=False)  # moves the
    assert _ids(llm.generate(prompts, seeded, use_tqdm=False)) == first                           # engine's RNG

    logprobs = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    logprobs.logprobs = 2
    out = llm.generate(prompts[:1], logprobs, use_tqdm=False)[0]
    assert len(out["logprobs"]) == 3 and all(len(entry) >= 2 for entry in out["logprobs"])

    stop_id = greedy[0][2]
    late = SamplingParams(temperature=0, max_tokens=8)
    late.stop_token_ids, late.min_tokens = [stop_id], 4
    out = llm.generate(prompts[:1], late, use_tqdm=False)[0]
    assert stop_id not in out["token_ids"][:4] and len(out["token_ids"]) >= 4


def test_assigned_stop_string_stops(llm):
    prompt = random_prompts(1, 10, 10, seed=42)[0]
    ref_ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                           use_tqdm=False)[0]["token_ids"]
    start = next(i for i in range(3, 57) if all(t < 128 for t in ref_ids[i:i + 3]))
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    sp.stop = bytes(ref_ids[start:start + 3]).decode()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and len(out["token_ids"]) <= start + 3


def test_assigned_bad_values_are_refused_at_admission(llm):
    for field, value, error in [("temperature", -1, ValueError), ("top_p", 0.0, ValueError),
                                ("stop", 5, TypeError), ("seed", 2 ** 64, ValueError), ("n", 0, ValueError)]:
        sp = SamplingParams(max_tokens=2)
        setattr(sp, field, value)
        with pytest.raises(error, match=field):
            llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    assert not llm.requests and llm.is_finished()  # nothing was admitted


def test_admitted_params_are_a_copy(llm):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.add_request([1, 2, 3], sp)
    sp.max_tokens = 1  # after admission: the running request keeps what it was admitted with
    done = []
    while not llm.is_finished():
        done += llm.step()[0]
    assert [len(ids) for _, ids in done] == [6]


# ---- hostile values ------------------------------------------------------------------------------
def test_bad_values_never_reach_a_step(llm):
    vocab = llm.config.hf_config.vocab_size
    with pytest.raises(ValueError, match=r"stop_token_ids \[100000\] are outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[100000], min_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="seed must be"):
        SamplingParams(seed=2 ** 64)
    with pytest.raises(TypeError, match="stop must be a string or a list of strings, got 5"):
        SamplingParams(stop=5)
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    with pytest.raises(ValueError, match=r"keys \['multi_modal_data'\]"):
        llm.generate([{"prompt_token_ids": [1, 2], "multi_modal_data": {}}], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt_token_ids must be a list of ints, got 'abc'"):
        llm.generate([{"prompt_token_ids": "abc"}], use_tqdm=False)  # was tokenized as text
    with pytest.raises(TypeError, match="messages must be a conversation"):
        llm.chat("hello", use_tqdm=False)
    # the largest seed, and its sibling's (seed + 1 wraps to 0), run and repeat
    sp = SamplingParams(n=2, seed=2 ** 64 - 1, temperature=1.0, max_tokens=5, ignore_eos=True)
    a, b = (llm.generate([[3, 4, 5]], sp, use_tqdm=False)[0]["outputs"] for _ in range(2))
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]
    # a tiny temperature is greedy, not NaN
    prompts = random_prompts(3, 5, 20, seed=72)
    tiny_t = SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True)
    assert _ids(llm.generate(prompts, tiny_t, use_tqdm=False)) == _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.generate([[vocab - 1]], GREEDY, use_tqdm=False)[0]["finish_reason"] == "length"  # still usable


def test_a_failure_that_is_one_requests_own_ends_that_request(tiny):
    """A request whose text cannot be decoded (a tokenizer that raises on some id) ends with
    finish_reason "error"; the other requests, and the engine, go on."""
    llm = LLM(tiny, **ENGINE)
    try:
        good = random_prompts(2, 5, 20, seed=73)
        ref = _ids(llm.generate(good, GREEDY, use_tqdm=False))
        mark = next(t for t in range(256) if all(t not in r + p for r, p in zip(ref, good)))
        tokenizer = llm.tokenizer

        class Faulty:
            def __getattr__(self, name):
                return getattr(tokenizer, name)

            def decode(self, ids, **kw):
                if mark in ids:
                    raise ValueError(f"cannot decode token {mark}")
                return tokenizer.decode(ids, **kw)

        llm.tokenizer = Faulty()
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["never-there"])
        out = llm.generate(good + [[1, 2, mark]], sp, use_tqdm=False)
        assert _ids(out[:2]) == ref
        assert out[2]["finish_reason"] == "error" and "cannot decode token" in out[2]["error"]
        assert_no_leaks(llm)
        llm.tokenizer = tokenizer
        assert _ids(llm.generate(good, GREEDY, use_tqdm=False)) == ref
    finally:
        llm.exit()


def test_a_request_whose_sampling_inputs_fail_ends_alone(tiny, monkeypatch):
    llm = LLM(tiny, **ENGINE)
    try:
        prompts = random_prompts(3, 5, 20, seed=74)
        ref = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
        runner, original = llm.model_runner, llm.model_runner.prepare_sampling
        poisoned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, top_k=3)

        def prepare_sampling(seqs, is_prefill):
            if any(seq.sampling_params.top_k == 3 for seq in seqs):
                raise RuntimeError("this request's sampling inputs cannot be built")
            return original(seqs, is_prefill)

        monkeypatch.setattr(runner, "prepare_sampling", prepare_sampling)
        out = llm.generate(prompts + [[9, 9, 9]], [GREEDY] * 3 + [poisoned], use_tqdm=False)
        assert _ids(out[:3]) == ref and out[3]["finish_reason"] == "error" and out[3]["token_ids"] == []
        assert_no_leaks(llm)
    finally:
        llm.exit()


def test_a_kv_cache_too_large_to_allocate_is_named(tiny):
    with pytest.raises(ValueError, match=r"cannot allocate a KV cache of 1000000000 blocks .*num_kvcache_blocks"):
        LLM(tiny, kvcache_block_size=16, num_kvcache_blocks=10 ** 9)


# ---- life cycle ---------------------------------------------------------------------------------
def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def test_del_frees_the_engine_and_its_memory(tiny):
    before = _rss_mib()
    llm = LLM(tiny, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=16384,  # a 256 MiB KV cache
              device="cpu")
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    engine, cache = weakref.ref(llm), weakref.ref(llm.model_runner.kv_cache)
    assert _rss_mib() - before > 200
    del llm
    gc.collect()
    assert engine() is None and cache() is None
    assert _rss_mib() - before < 100


@pytest.mark.gpu
def test_del_frees_the_device_memory(tiny):
    import torch
    before = torch.cuda.memory_allocated()
    llm = LLM(tiny, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=16384, device="cuda")
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert torch.cuda.memory_allocated() - before > 200 * 2 ** 20
    engine = weakref.ref(llm)
    del llm
    gc.collect()
    assert engine() is None and torch.cuda.memory_allocated() - before < 50 * 2 ** 20


def test_context_manager_shutdown_alias_and_idempotent_exit(tiny):
    with LLM(tiny, **ENGINE) as llm:
        assert len(llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0]["token_ids"]) == 8
    assert llm.model_runner is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    llm.shutdown()
    llm.exit()
    other = LLM(tiny, **ENGINE)
    assert LLM.shutdown is LLM.exit
    other.shutdown()
    assert other.model_runner is None


# ---- chat ---------------------------------------------------------------------------------------
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}[nothink]{% endif %}"
            "{% if tools %}[tools:{{ tools | length }}]{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _chat_prompt(llm, messages, **kw) -> str:
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, chat_template=TEMPLATE, **kw)
    return llm.tokenizer.decode(out[0]["prompt_token_ids"])


def test_chat_keywords_keep_their_meaning(llm):
    messages = [{"role": "user", "content": "hi"}]
    assert _chat_prompt(llm, messages) == "<user>hi<assistant>"
    assert _chat_prompt(llm, messages, chat_template_kwargs={"enable_thinking": False}) == \
        "<user>hi[nothink]<assistant>"
    assert _chat_prompt(llm, messages, add_generation_prompt=False) == "<user>hi"
    assert _chat_prompt(llm, messages, tools=[{"type": "function", "function": {"name": "f"}}]) == \
        "<user>hi[tools:1]<assistant>"
    partial = messages + [{"role": "assistant", "content": "Hel"}]
    assert _chat_prompt(llm, partial, add_generation_prompt=False, continue_final_message=True).endswith("Hel")
    with pytest.raises(TypeError, match="temperature"):
        llm.chat(messages, temperature=0)  # a keyword chat does not take is refused by name
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(partial, continue_final_message=True)
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat(messages, lora_request=object())


# ---- admission counts the blocks a sequence needs -----------------------------------------------
def test_completions_of_one_long_prompt_run_together(tiny):
    """n=2 of a 100-token prompt (6 full blocks + 1) in a 12-block cache: the second completion needs
    one new block, not seven, so both run at once."""
    llm = LLM(tiny, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=12)
    running = []
    schedule = llm.scheduler.schedule

    def spy():
        out = schedule()
        running.append(len(llm.scheduler.running))
        return out

    llm.scheduler.schedule = spy
    try:
        prompt = random_prompts(1, 100, 100, seed=75)[0]
        out = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)[0]
        assert_no_leaks(llm)
    finally:
        llm.exit()
    assert max(running) == 2
    assert out["outputs"][0]["token_ids"] == out["outputs"][1]["token_ids"] and len(out["token_ids"]) == 20


# ---- streams and threads ------------------------------------------------------------------------
def test_leaving_a_stream_early_aborts_its_requests(llm):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for _ in llm.stream(random_prompts(3, 5, 10, seed=76), sp):
        break
    assert not llm.requests and llm.is_finished()
    assert_no_leaks(llm)

    def body():
        for _ in llm.stream(random_prompts(3, 5, 10, seed=77), sp):
            raise KeyError("user code fails inside the loop")

    with pytest.raises(KeyError):
        body()
    gc.collect()
    assert not llm.requests and llm.is_finished()
    assert len(llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0]["token_ids"]) == 8


def test_generate_inside_a_stream_loop_and_interleaved_streams(llm):
    prompts = random_prompts(2, 5, 10, seed=78)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = llm.generate(prompts + [[5, 6, 7]], sp, use_tqdm=False)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    inner = None
    for piece in llm.stream(prompts, sp):
        tokens[piece["index"]] += piece["token_ids"]
        if inner is None:
            inner = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    assert [tokens[0], tokens[1]] == _ids(ref[:2]) and inner["token_ids"] == ref[2]["token_ids"]

    a, b = llm.stream(prompts[:1], sp), llm.stream(prompts[1:], sp)
    got: dict[str, list[int]] = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:
        for name, it in list(live.items()):
            piece = next(it, None)
            if piece is None:
                del live[name]
            else:
                got[name] += piece["token_ids"]
    assert [got["a"], got["b"]] == _ids(ref[:2])
    assert_no_leaks(llm)


def test_streamed_text_with_a_stop_string_equals_generate(llm):
    for seed in range(80, 86):
        prompt = random_prompts(1, 10, 10, seed=seed)[0]
        ref_ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                               use_tqdm=False)[0]["token_ids"]
        start = next((i for i in range(2, 36) if all(32 <= t < 127 for t in ref_ids[i:i + 4])), None)
        if start is None:
            continue
        stop = bytes(ref_ids[start:start + 4]).decode()
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
        final = llm.generate([prompt], sp, use_tqdm=False)[0]
        pieces = [p["text"] for p in llm.stream([prompt], sp)]
        assert final["finish_reason"] == "stop" and "".join(pieces) == final["text"], (pieces, final["text"])


def _in_threads(work, n: int = 2) -> list:
    """work(i) in n threads at once; its results in order (an exception raised in a thread is re-raised)."""
    results: list = [None] * n

    def run(i):
        try:
            results[i] = work(i)
        except Exception as e:  # surfaced below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def test_generate_from_two_threads(llm):
    batches = [random_prompts(4, 5, 30, seed=90 + i) for i in range(2)]
    ref = [_ids(llm.generate(b, GREEDY, use_tqdm=False)) for b in batches]
    assert _in_threads(lambda i: _ids(llm.generate(batches[i], GREEDY, use_tqdm=False))) == ref
    assert_no_leaks(llm)


def test_engines_in_their_own_threads_are_independent(tiny):
    prompts = random_prompts(4, 5, 30, seed=95)
    ref = _ids(LLM(tiny, **ENGINE).generate(prompts, GREEDY, use_tqdm=False))

    def work(i):
        with LLM(tiny, **ENGINE) as llm:
            return _ids(llm.generate(prompts, GREEDY, use_tqdm=False))

    assert _in_threads(work) == [ref, ref]
