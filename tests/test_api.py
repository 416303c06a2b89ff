"""Specification of the public API: generate, stream, chat, add_request/step and the outputs'
fields, the LLM's life cycle (exit, shutdown, the context manager), and its input validation: a bad
prompt, engine keyword or argument is refused with a ValueError or TypeError that names it, and the
engine stays usable."""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil

import pytest
from conftest import CPU_ENGINE, ENGINE, GREEDY, assert_no_leaks, random_prompts, token_ids_of

from nanovllm import LLM, CompletionOutput, EngineArgs, LLMEngine, RequestOutput, SamplingParams


# ---- generate and its outputs --------------------------------------------------------------------
def test_outputs_in_prompt_order_and_text(llm, oracle, tiny):
    prompts = ["Hello, Nano-vLLM.", "a", "The quick brown fox jumps over the lazy dog " * 3]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 17, 9)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outputs):
        ids = llm.tokenizer.encode(prompt)
        assert out["token_ids"] == oracle.greedy(tiny, ids, sp.max_tokens)[0]
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    assert_no_leaks(llm)


def test_token_id_prompt_and_single_params(llm):
    out = llm.generate([[1, 2, 3], [4, 5]],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [3, 3]


def test_outputs_are_vllms_objects_and_answer_the_old_keys(llm, oracle, tiny):
    text = "The quick brown fox jumps over the lazy dog."
    prompt = llm.tokenizer.encode(text)  # 44 tokens
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    c = out.outputs[0]
    assert c.index == 0 and c.token_ids == oracle.greedy(tiny, prompt, 6)[0] and c.finished()
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert c.finish_reason == "length" and c.stop_reason is None
    # not asked for
    assert c.cumulative_logprob is None and c.logprobs is None and out.prompt_logprobs is None
    assert (out.prompt is None and out.prompt_token_ids == prompt and out.finished
            and isinstance(out.request_id, str))
    assert 0 < out.metrics.time_to_first_token <= out.metrics.total_time
    # nano-vllm's keys (completion 0) and the keys of the dicts earlier versions returned
    assert (out["text"] == c.text and out["token_ids"] == c.token_ids
            and out["finish_reason"] == "length")
    assert out["outputs"][0]["text"] == c.text and out["prompt_token_ids"] == prompt
    assert (out["metrics"]["total_time"] == out.metrics.total_time
            and out["num_cached_tokens"] == out.num_cached_tokens)
    assert ("logprobs" not in out and "prompt_logprobs" not in out and "error" not in out
            and "text" in out)
    assert out.get("logprobs", "absent") == "absent" and dict(out)["token_ids"] == c.token_ids
    assert (list(out) == out.keys() and len(out) == len(out.keys())
            and dict(out.items()) == dict(out))
    with pytest.raises(KeyError):
        out["no_such_field"]
    again = llm.generate([{"prompt": text}], sp, use_tqdm=False)[0]
    # 2 blocks
    assert (again.prompt == text and again["token_ids"] == c.token_ids
            and again.num_cached_tokens == 32)
    assert again.request_id != out.request_id
    chat = llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False)[0]
    assert chat.prompt == llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_stop_reason_names_what_ended_a_completion(llm):
    prompt = random_prompts(1, 10, 10, seed=51)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0]
    free = free.outputs[0]
    token = free.token_ids[3]
    by_token = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                     stop_token_ids=[token],
                                                     ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token
    assert by_token.token_ids == free.token_ids[:free.token_ids.index(token) + 1]
    # the stop token's text is left out unless include_stop_str_in_output
    decode = llm.tokenizer.decode
    assert by_token.text == decode(by_token.token_ids[:-1], skip_special_tokens=True)
    kept = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token], ignore_eos=True,
                          include_stop_str_in_output=True)
    kept_text = llm.generate([prompt], kept, use_tqdm=False)[0]["text"]
    assert kept_text == decode(by_token.token_ids, skip_special_tokens=True)
    streamed = "".join(p["text"] for p in llm.stream([prompt], SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[token], ignore_eos=True)))
    assert streamed == by_token.text
    longer = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                          use_tqdm=False)[0]["token_ids"]
    # the byte tokenizer: two printable ASCII tokens in a row make a stop string
    start = next(i for i in range(1, 58) if all(32 <= t < 127 for t in longer[i:i + 2]))
    stop = bytes(longer[start:start + 2]).decode()
    by_text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, stop=[stop],
                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (by_text.finish_reason == "stop" and by_text.stop_reason == stop
            and stop not in by_text.text)
    eos = llm.core.outputs.eos_token_ids, llm.core.outputs.eos_token_id
    # as though it were the model's EOS
    llm.core.outputs.eos_token_ids, llm.core.outputs.eos_token_id = {token}, token
    try:
        by_eos = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12),
                              use_tqdm=False)[0].outputs[0]
    finally:
        llm.core.outputs.eos_token_ids, llm.core.outputs.eos_token_id = eos
    assert (by_eos.finish_reason == "stop" and by_eos.stop_reason is None
            and by_eos.token_ids == by_token.token_ids)


# ---- vLLM's engine loop and LLM methods ----------------------------------------------------------
def test_vllms_engine_loop(llm):
    """The shape of vLLM's llm_engine example: add_request(request_id, prompt, params), step() until
    no request is unfinished; outputs are cumulative, a finished request is reported once;
    abort_request by id."""
    engine = llm.llm_engine
    assert engine.step() == []  # nothing to run: no outputs (vLLM's)
    prompts = random_prompts(3, 5, 20, seed=81)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    reference = llm.generate(prompts, sp, use_tqdm=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"req-{i}", {"prompt_token_ids": prompt}, sp)
    engine.add_request("cut", prompts[0],
                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    with pytest.raises(ValueError, match="req-0"):
        engine.add_request("req-0", prompts[0], sp)  # an id that is running
    finished, seen, texts, reported = {}, {}, {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, text = out.outputs[0].token_ids, out.outputs[0].text
            # cumulative, only when it grew
            assert len(tokens) > seen.get(out.request_id, 0) or out.finished
            # the text grows too (incrementally decoded)
            assert text.startswith(texts.get(out.request_id, ""))
            seen[out.request_id], texts[out.request_id] = len(tokens), text
            reported.append(out)
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out
        if ("req-0" in finished and "cut" not in finished
                and engine.get_num_unfinished_requests() > 0):
            engine.abort_request("cut")
            assert not any(r.request_id == "cut" for r in llm.requests.values())
    assert ([finished[f"req-{i}"].outputs[0].token_ids for i in range(3)]
            == [r["token_ids"] for r in reference])
    # the text is a stream's: the same pieces, whole
    streamed = "".join(p["text"] for p in llm.stream([prompts[1]], sp))
    assert finished["req-1"].outputs[0].text == streamed
    # an earlier report keeps what it said then
    assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids)
               for o in reported if o.request_id != "cut")
    assert "cut" not in finished and engine.model_config.max_model_len == llm.config.max_model_len
    assert engine.get_tokenizer() is llm.tokenizer and llm.get_tokenizer() is llm.tokenizer
    # a request that finishes while another call runs the steps is reported by the next step(), then
    # forgotten
    engine.add_request("meanwhile", prompts[1],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                 use_tqdm=False)
    assert engine.has_unfinished_requests()
    (late,) = engine.step()
    assert late.request_id == "meanwhile" and late.finished and len(late.outputs[0].token_ids) == 3
    assert not engine.has_unfinished_requests() and not llm.requests
    assert_no_leaks(llm)


def test_engine_from_engine_args_and_default_sampling_params(tiny, tmp_path):
    """get_default_sampling_params reads generation_config.json (as vLLM) and generate uses it when
    given none."""
    path = tmp_path / "with_generation_config"
    shutil.copytree(tiny, path)
    (path / "generation_config.json").write_text(json.dumps(dict(
        temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=7, do_sample=True)))
    engine = LLMEngine.from_engine_args(EngineArgs(str(path), **ENGINE))
    try:
        sp = engine.get_default_sampling_params()
        assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0.6, 0.95, 20, 7)
        out = engine.generate([[1, 2, 3]], use_tqdm=False)[0]
        tokens = out.outputs[0].token_ids
        assert len(tokens) <= 7 and (len(tokens) == 7) == (out.outputs[0].finish_reason == "length")
    finally:
        engine.exit()
    plain = SamplingParams()
    # vLLM's keyword: vLLM's own defaults
    opted_out = LLMEngine(str(path), generation_config="vllm", **ENGINE)
    try:
        sp = opted_out.get_default_sampling_params()
        assert (sp.temperature, sp.top_k, sp.max_tokens) == (plain.temperature, plain.top_k, 16)
    finally:
        opted_out.exit()
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(path), generation_config="nowhere", **ENGINE)


def test_vllm_forms_without_sampling_params_generate_vllms_16_tokens(tiny, tmp_path):
    """nano-vllm's SamplingParams() keeps 64 tokens; vLLM's forms without sampling params get vLLM's
    16, as get_default_sampling_params gives when generation_config.json sets no max_new_tokens."""
    # greedy, no max_new_tokens
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    engine = LLM(tiny, generation_config=str(tmp_path), **ENGINE)
    try:
        assert (SamplingParams().max_tokens == 64
                and engine.get_default_sampling_params().max_tokens == 16)
        prompt = [1, 2, 3]
        longer = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=17),
                                 use_tqdm=False)
        expected = longer[0].outputs[0].token_ids[:16]
        assert len(longer[0].outputs[0].token_ids) == 17  # no EOS before the 17th token
        assert engine.generate([prompt], use_tqdm=False)[0].outputs[0].token_ids == expected
        engine.add_request("by-id", prompt, None)
        while engine.has_unfinished_requests():
            finished = [o for o in engine.step() if o.finished]
        assert finished[0].outputs[0].token_ids == expected
        chat = engine.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0].outputs[0]
        assert (len(chat.token_ids) == 16
                or chat.finish_reason == "stop" and len(chat.token_ids) < 16)
    finally:
        engine.exit()


def test_engine_args_as_command_line_flags():
    """vLLM's EngineArgs.add_cli_args / from_cli_args: a flag per engine keyword, unset ones left to
    the defaults."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", "m", "--max-model-len", "256", "--block-size", "16", "--enforce-eager",
         "--dtype", "half", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
         "--hf-token", "t"]))
    assert args.model == "m" and args.kwargs == dict(
        max_model_len=256, block_size=16, enforce_eager=True, dtype="half",
        gpu_memory_utilization=0.5, enable_prefix_caching=False, hf_token="t")
    assert EngineArgs.from_cli_args(parser.parse_args([])).kwargs == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", "many"])


def test_reset_prefix_cache(llm):
    prompt = random_prompts(1, 40, 40, seed=82)[0]
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], sp, use_tqdm=False)
    assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 32
    llm.add_request("running", prompt, sp)
    llm.step()  # its prefill: it holds blocks now
    assert llm.reset_prefix_cache() is False  # refused while a request holds blocks (vLLM's)
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 0
    assert_no_leaks(llm)


# ---- streams -------------------------------------------------------------------------------------
def test_stream_yields_the_generated_text(llm):
    prompts = ["Hello", "streaming works"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    final = llm.generate(prompts, sp, use_tqdm=False)
    pieces: dict[int, list[str]] = {0: [], 1: []}
    finished = []
    for chunk in llm.stream(prompts, sp):
        pieces[chunk["index"]].append(chunk["text"])
        if chunk["finished"]:
            finished.append((chunk["index"], chunk["finish_reason"]))
    assert sorted(finished) == [(0, "length"), (1, "length")]
    for i in (0, 1):
        assert "".join(pieces[i]) == final[i]["text"]
    assert llm.is_finished() and not llm.requests


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
    assert ([tokens[0], tokens[1]] == token_ids_of(ref[:2])
            and inner["token_ids"] == ref[2]["token_ids"])

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
    assert [got["a"], got["b"]] == token_ids_of(ref[:2])
    assert_no_leaks(llm)


def test_streamed_text_with_a_stop_string_equals_generate(llm):
    for seed in range(80, 86):
        prompt = random_prompts(1, 10, 10, seed=seed)[0]
        ref_ids = llm.generate([prompt],
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                               use_tqdm=False)[0]["token_ids"]
        start = next((i for i in range(2, 36) if all(32 <= t < 127 for t in ref_ids[i:i + 4])),
                     None)
        if start is None:
            continue
        stop = bytes(ref_ids[start:start + 4]).decode()
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
        final = llm.generate([prompt], sp, use_tqdm=False)[0]
        pieces = [p["text"] for p in llm.stream([prompt], sp)]
        assert (final["finish_reason"] == "stop"
                and "".join(pieces) == final["text"]), (pieces, final["text"])


# ---- chat ----------------------------------------------------------------------------------------
def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hi there"}]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.chat(messages, sp, use_tqdm=False)
    ids = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = llm.generate([ids], sp, use_tqdm=False)
    assert out[0]["token_ids"] == ref[0]["token_ids"]
    assert len(llm.chat([messages, messages], sp, use_tqdm=False)) == 2


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}[nothink]{% endif %}"
            "{% if tools %}[tools:{{ tools | length }}]{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _chat_prompt(llm, messages, **kw) -> str:
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                   chat_template=TEMPLATE, **kw)
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
    assert _chat_prompt(llm, partial, add_generation_prompt=False,
                        continue_final_message=True).endswith("Hel")
    with pytest.raises(TypeError, match="temperature"):
        llm.chat(messages, temperature=0)  # a keyword chat does not take is refused by name
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(partial, continue_final_message=True)
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat(messages, lora_request=object())


def test_chat_joins_text_parts_and_refuses_malformed_messages(llm):
    """vLLM's text parts are joined by newlines; a message without a string role, content that is
    neither a string nor a list of parts, or a part other than text (the engine is text-only) is
    refused by index."""
    parts = [{"role": "user",
              "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    assert _chat_prompt(llm, parts) == "<user>hi\nthere<assistant>"
    # vLLM's: no text
    assert _chat_prompt(llm, [{"role": "user", "content": None}]) == "<user><assistant>"
    ok = {"role": "user", "content": "hi"}
    image = {"role": "user", "content": [{"type": "text", "text": "see"},
                                         {"type": "image_url",
                                          "image_url": {"url": "http://x/y.png"}}]}
    cases = [([{"content": "hi"}], r"messages\[0\]\['role'\] must be a string, got None"),
             ([ok, {"role": None, "content": "hi"}], r"messages\[1\]\['role'\] must be a string"),
             ([{"role": 3, "content": "hi"}], r"messages\[0\]\['role'\]"),
             ([{"role": "user", "content": 5}],
              r"messages\[0\]\['content'\] must be a string or a list"),
             ([{"role": "user", "content": {"text": "hi"}}], r"messages\[0\]\['content'\]"),
             ([image], r"messages\[0\]\['content'\]\[1\] has type 'image_url'.*text-only"),
             ([{"role": "user", "content": [{"type": "text", "text": 5}]}],
              r"messages\[0\]\['content'\]\[0\]"),
             ([[ok], [ok, image]], r"messages\[1\]\[1\]\['content'\]\[1\] has type 'image_url'")]
    for messages, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=TEMPLATE)
    assert llm.is_finished()


# ---- life cycle ----------------------------------------------------------------------------------
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


# ---- engine keywords -----------------------------------------------------------------------------
def test_vllm_engine_keywords(tiny):
    engine = LLM(tiny, block_size=16, enable_prefix_caching=False, max_model_len=256,
                 num_kvcache_blocks=64, seed=3)
    try:
        assert engine.config.kvcache_block_size == 16
        prompt = list(range(40))
        engine.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
        engine.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
        assert engine.scheduler.block_manager.num_cache_hits == 0
    finally:
        engine.exit()
    with pytest.raises(TypeError, match="not both"):
        LLM(tiny, block_size=16, kvcache_block_size=16)


def test_default_block_size_is_the_backends(tiny):
    """64 tokens unless flash-attn (its paged KV: multiples of 256); None, vLLM's "default", too; a
    given size stays, and one the backend cannot take is refused naming it."""
    from nanovllm.config import DEFAULT_BLOCK_SIZE, Config
    from nanovllm.entrypoints.llm import create_engine_config
    assert Config(tiny, device="cpu").kvcache_block_size == 64
    assert create_engine_config(tiny, device="cpu", block_size=None).kvcache_block_size == 64
    assert Config(tiny, device="cpu", kvcache_block_size=32).kvcache_block_size == 32
    from nanovllm.layers import attention
    assert set(DEFAULT_BLOCK_SIZE) == set(attention.BACKENDS)   # every backend has one
    # a flash-attn that takes this configuration, to see its default
    fake = dict(attention.BACKENDS,
                **{"flash-attn": (lambda *shape: [], attention.BACKENDS["flash-attn"][1])})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "BACKENDS", fake)
        assert Config(tiny, device="cpu", attention_backend="flash-attn").kvcache_block_size == 256
    with pytest.raises(ValueError, match="kvcache_block_size"):
        Config(tiny, device="cpu", kvcache_block_size=0)
    with pytest.raises(ValueError, match="kvcache_block_size 48 .Triton"):   # not a power of two
        Config(tiny, device="cpu", attention_backend="triton", kvcache_block_size=48)


def test_skip_tokenizer_init_rejects_text(tiny, tmp_path):
    ckpt = tmp_path / "notok"
    shutil.copytree(tiny, ckpt, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    engine = LLM(str(ckpt), skip_tokenizer_init=True, **ENGINE)
    try:
        out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True),
                              use_tqdm=False)[0]
        assert out["text"] == "" and len(out["token_ids"]) == 3
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            engine.generate(["text"], SamplingParams(), use_tqdm=False)
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            engine.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            engine.get_tokenizer()  # vLLM's: an error, not None
        with pytest.raises(ValueError, match="lora_request"):
            engine.generate([[1, 2]], use_tqdm=False, lora_request=object())
        with pytest.raises(ValueError, match="priority"):
            engine.generate([[1, 2]], use_tqdm=False, priority=[1])
    finally:
        engine.exit()


def test_seed_seeds_pythons_numpys_and_torchs_global_generators(tiny):
    """As vLLM's set_random_seed: LLM(seed=...) seeds random, numpy.random and torch."""
    import random

    import numpy as np
    import torch

    def draws(seed):
        random.seed(), np.random.seed(), torch.seed()  # unpredictable states first
        LLM(tiny, seed=seed, **CPU_ENGINE).exit()
        return random.random(), float(np.random.random()), float(torch.rand(1))

    first = draws(5)
    assert draws(5) == first
    assert all(a != b for a, b in zip(draws(6), first))


def test_max_logprobs_bounds_the_requested_logprobs_at_admission(llm, tiny):
    """vLLM's max_logprobs (20; -1: no limit but the vocabulary) refuses a request asking for more,
    in vLLM's words."""
    assert llm.config.max_logprobs == 20
    with pytest.raises(ValueError, match="Requested sample logprobs of 21, which is greater than "
                                         "max allowed: 20"):
        llm.generate(["a"], SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="Requested prompt logprobs of 21, which is greater than "
                                         "max allowed: 20"):
        llm.generate(["a"], SamplingParams(prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="sample logprobs of 21"):
        llm.add_request("too-many", [1, 2], SamplingParams(logprobs=21))
    assert llm.is_finished() and not llm.has_unfinished_requests()
    out = llm.generate(["ab"], SamplingParams(max_tokens=1, logprobs=20, prompt_logprobs=20),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 20 and len(out.prompt_logprobs[1]) >= 20
    with (LLM(tiny, max_logprobs=2, **CPU_ENGINE) as few,
          LLM(tiny, max_logprobs=-1, **CPU_ENGINE) as unlimited):
        with pytest.raises(ValueError,
                           match="sample logprobs of 3, which is greater than max allowed: 2"):
            few.generate([[1, 2]], SamplingParams(logprobs=3), use_tqdm=False)
        out = unlimited.generate([[1, 2]], SamplingParams(max_tokens=1, logprobs=320),
                                 use_tqdm=False)[0]
        assert len(out.outputs[0].logprobs[0]) == 320
        with pytest.raises(ValueError,
                           match="sample logprobs of 321, which is greater than max allowed: 320"):
            unlimited.generate([[1, 2]], SamplingParams(logprobs=321), use_tqdm=False)
    for bad, error in ((-2, ValueError), (1.5, TypeError)):
        with pytest.raises(error, match="max_logprobs"):
            LLM(tiny, max_logprobs=bad, **CPU_ENGINE)


def test_priority_list_of_the_wrong_length_is_refused(llm):
    with pytest.raises(ValueError, match=r"prompts \(2\) and priority \(1\)"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=False, priority=[0])
    assert llm.is_finished()
    assert len(llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=False,
                            priority=[0, 0])) == 2


def test_unknown_keyword_is_named(tiny):
    with pytest.raises(TypeError, match="max_num_seq'"):
        LLM(tiny, max_num_seq=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(kvcache_block_size="16"), "kvcache_block_size"),
    (dict(dtype="float64"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3"),
])
def test_bad_config_values(tiny, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LLM(tiny, **kwargs)


def test_bad_model_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_a_config_json_that_is_not_a_json_object_is_named(tiny, tmp_path):
    for name, text, match in (("broken", '{"architectures": [', "is not valid JSON"),
                              ("list", "[1, 2]", "must hold a JSON object, got a list")):
        ckpt = tmp_path / name
        shutil.copytree(tiny, ckpt)
        (ckpt / "config.json").write_text(text)
        with pytest.raises(ValueError, match=re.escape(str(ckpt / "config.json")) + ".*" + match):
            LLM(str(ckpt), device="cpu")


def test_a_quantization_config_that_is_not_an_object_is_named(tiny, tmp_path):
    from conftest import edited_checkpoint
    for bad in ("fp8", ["fp8"], 8):  # (null is no quantization_config)
        ckpt = edited_checkpoint(tiny, tmp_path / type(bad).__name__, quantization_config=bad)
        with pytest.raises(ValueError, match="quantization_config must be a JSON object"):
            LLM(ckpt, device="cpu")


def test_attention_backend_choice_is_checked_up_front(tiny):
    with pytest.raises(ValueError, match="attention_backend must be"):
        LLM(tiny, attention_backend="xformers")
    with pytest.raises(ValueError, match=r"attention_backend='flash-attn' does not "
                                         r"support.*kvcache_block_size 16"):
        LLM(tiny, device="cpu", kvcache_block_size=16, attention_backend="flash-attn")


def test_auto_backend_on_cpu_is_the_reference(llm):
    assert llm.model_runner.attention_backend.name == ("triton" if llm.config.device == "cuda"
                                                       else "torch")


def test_kv_budget_too_small_for_one_block(tiny):
    with pytest.raises(ValueError, match="no memory left for the KV cache.*cpu_kvcache_space"):
        LLM(tiny, device="cpu", cpu_kvcache_space=1e-9)


def test_max_model_len_past_the_models_positions_is_lowered_and_said(tiny, caplog):
    from nanovllm.config import Config
    with caplog.at_level("INFO", logger="nanovllm"):
        config = Config(tiny, device="cpu", max_model_len=100_000)
    assert config.max_model_len == config.hf_config.max_position_embeddings
    assert (f"max_model_len lowered from 100000 to the model's {config.max_model_len} positions"
            in caplog.text)


def test_prompt_larger_than_the_kv_cache(tiny, caplog):
    engine = LLM(tiny, kvcache_block_size=16, num_kvcache_blocks=2)
    try:
        # max_model_len is lowered to what the cache holds, and says so (vLLM refuses such a start
        # instead)
        assert engine.config.max_model_len == 32
        assert "max_model_len lowered from 1024 to 32" in caplog.text
        with pytest.raises(ValueError,
                           match=r"max_model_len=32 \(the whole KV cache holds 32 tokens\)"):
            engine.generate([[5] * 40], SamplingParams(), use_tqdm=False)
        out = engine.generate([[5] * 20],
                              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                              use_tqdm=False)[0]
    finally:
        engine.exit()
    assert len(out["token_ids"]) == 12  # stops when the sequence fills the whole cache


# ---- bad prompts and arguments -------------------------------------------------------------------
@pytest.mark.parametrize("prompts, params, match", [
    ([[]], None, "prompt 0: the decoder prompt cannot be empty"),
    (["ok", ""], None, "prompt 1: the decoder prompt cannot be empty"),
    ([[1, 2, 999]], None,
     r"prompt 0: token id 999 is out of vocabulary \(ids \[999\] outside \[0, 320\)\)"),
    ([[1, -2]], None, r"token id -2 is out of vocabulary \(ids \[-2\] outside \[0, 320\)"),
    ([[1, 2.5]], None, "list of ints"),
    ([[7] * 600], None,
     r"prompt 0 \(length 600\) plus at least 1 output token is longer than the maximum "
                        r"context length: max_model_len=512"),
    ([[7] * 512], None, r"prompt 0 \(length 512\) plus .* maximum context length"),
    (["\ud800"], None, "prompt 0 is not valid Unicode text"),
    ([{"prompt": "a\udfffb"}], None, "prompt 0 is not valid Unicode text"),
    (["a", "b"], [SamplingParams()], "2 prompts but 1"),
    ([1.5], None, "a string, a list of ints or a dict"),
    (["a"], SamplingParams(logprobs=321),
     "Requested sample logprobs of 321, which is greater than max allowed: 20"),
    (["a"], SamplingParams(prompt_logprobs=10_000),
     "Requested prompt logprobs of 10000, which is greater than"),
])
def test_bad_prompts_leave_engine_usable(llm, prompts, params, match):
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate(prompts, params or SamplingParams(), use_tqdm=False)
    assert llm.is_finished()
    assert len(llm.generate(["ok"], SamplingParams(max_tokens=2),
                            use_tqdm=False)[0]["token_ids"]) <= 2


def test_wrong_sampling_params_type(llm):
    with pytest.raises(TypeError, match="sampling_params must be"):
        llm.generate(["a"], {"temperature": 0}, use_tqdm=False)


# ---- the example script and the package ----------------------------------------------------------
def test_example_runs_without_arguments(tmp_path):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "example.py"), "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nanovllm:demo" in proc.stdout and "def fibonacci(n):" in proc.stdout
    assert "greedy (temperature 0)" in proc.stdout and "sampled (temperature 0.8" in proc.stdout


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_build_system_supports_the_license_string():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert isinstance(project["project"]["license"], str)  # PEP 639: setuptools >= 77
    assert "setuptools>=77" in project["build-system"]["requires"]


def test_a_prompt_past_the_context_says_vllms_words_too(tiny):
    """vLLM's tests match "maximum context length is" (a chat batch with a too-long prompt)."""
    with LLM(tiny, **CPU_ENGINE) as llm:
        with pytest.raises(ValueError, match=r"max_model_len=512; this model's maximum context "
                                             r"length is 512 tokens"):
            llm.generate([[7] * 600], SamplingParams(max_tokens=1), use_tqdm=False)
