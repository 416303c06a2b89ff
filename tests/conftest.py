"""Shared fixtures and helpers: tiny random checkpoints (built offline) and transformers as the
oracle."""
from __future__ import annotations

import os
import random

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; the variable is read when a
# kernel module is imported, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_model import build_tiny_model, build_tiny_qwen3

from nanovllm.sampling_params import SamplingParams

# One near-tie rule everywhere: at the first position where nanovllm and
# transformers differ, a top-2 logit gap below this in transformers means the rest is not compared.
NEAR_TIE = 1e-4

CHECKPOINTS = {
    # name: build_tiny_qwen3 overrides
    "gqa2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "gqa1_tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                      tie_word_embeddings=True),
    "gqa4_hd128_sharded": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                               max_shard_size="200KB", rope_theta=1e6, num_hidden_layers=3),
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_tiny_qwen3(str(root / name), **kw) for name, kw in CHECKPOINTS.items()}


@pytest.fixture(scope="session")
def tiny(checkpoints) -> str:
    return checkpoints["gqa2"]


LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
FAMILIES = {  # name: (architecture, build_tiny_model overrides)
    "qwen2_biases": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama3_rope_tied": ("llama", dict(head_dim=32, tie_word_embeddings=True, rope_theta=500000.0,
                                       rope_scaling=LLAMA3_ROPE)),
    "llama_linear_rope_all_biases": ("llama", dict(head_dim=32, attention_bias=True, mlp_bias=True,
                                                   num_key_value_heads=4,
                                                   rope_scaling=dict(rope_type="linear",
                                                                     factor=2.0))),
    "mistral": ("mistral", dict(head_dim=32, sliding_window=None, num_key_value_heads=1)),
    # sliding windows shorter than the prompts: Mistral's on every layer, Qwen2's from
    # max_window_layers on
    "mistral_window": ("mistral", dict(head_dim=32, sliding_window=24, num_key_value_heads=1)),
    "qwen2_window_mixed": ("qwen2", dict(head_dim=32, num_key_value_heads=2,
                                         use_sliding_window=True, sliding_window=20,
                                         max_window_layers=1)),
    # Qwen2.5's long-context configuration (YaRN), with an original context the prompts run past
    "qwen2_yarn": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2,
                                 rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                   original_max_position_embeddings=32))),
}


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    """One tiny checkpoint of every supported family but Qwen3 (test_models.py,
    test_tensor_parallel.py)."""
    root = tmp_path_factory.mktemp("families")
    return {name: build_tiny_model(str(root / name), arch, **kw)
            for name, (arch, kw) in FAMILIES.items()}


# An explicit cache size (honoured on every device): on a GPU, engines that live side by side
# in the test process must not each claim gpu_memory_utilization of it.
ENGINE = dict(kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=512)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # eight greedy tokens
# engines that run on CPU whatever the machine (tensor-parallel ones on gloo)
CPU_ENGINE = dict(kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=256, device="cpu")


@pytest.fixture(scope="module")
def llm(tiny):
    """One engine on the tiny checkpoint, shared by a test module."""
    from nanovllm import LLM
    engine = LLM(tiny, **ENGINE)
    yield engine
    engine.exit()


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class Oracle:
    """Greedy continuations from transformers (float32, full forward each step), cached."""

    def __init__(self):
        self.models, self.cache = {}, {}

    def model(self, path: str, device: str = "cpu", dtype=torch.float32):
        from transformers import AutoModelForCausalLM
        key = (path, device, dtype)
        if key not in self.models:
            self.models[key] = AutoModelForCausalLM.from_pretrained(path,
                                                                    dtype=dtype).to(device).eval()
        return self.models[key]

    @torch.no_grad()
    def greedy(self, path: str, prompt: list[int], n: int, device: str = "cpu",
               dtype=torch.float32):
        """(tokens, logits per generated position) of n greedy steps."""
        key = (path, tuple(prompt), n, device, dtype)
        if key not in self.cache:
            model = self.model(path, device, dtype)
            ids, tokens, logits = list(prompt), [], []
            for _ in range(n):
                step_logits = model(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
                tokens.append(int(step_logits.argmax()))
                logits.append(step_logits)
                ids.append(tokens[-1])
            self.cache[key] = (tokens, logits)
        return self.cache[key]


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    return Oracle()


def assert_matches_oracle(oracle: Oracle, path: str, prompts, outputs, n: int,
                          max_near_ties: int | None = None, tie: float = NEAR_TIE, **kw) -> int:
    """Asserts token-for-token equality under the near-tie rule; returns the number of near-ties.

    ``tie`` stays NEAR_TIE except where a test compares bf16 runs and says why."""
    near_ties = 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ref, logits = oracle.greedy(path, prompt, n, **kw)
        got = out["token_ids"]
        assert len(got) == n, f"prompt {i}: {len(got)} tokens, expected {n}"
        if got == ref:
            continue
        j = next(k for k in range(n) if got[k] != ref[k])
        top2 = logits[j].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < tie, f"prompt {i} (len {len(prompt)}) differs at token {j}: " \
                          f"{got[j]} vs {ref[j]}, gap {gap:.3g}"
        near_ties += 1
    limit = max(1, len(prompts) // 16) if max_near_ties is None else max_near_ties
    assert near_ties <= limit, f"{near_ties} near-ties in {len(prompts)} sequences"
    if near_ties:
        print(f"near-ties: {near_ties}/{len(prompts)}")
    return near_ties


def assert_no_leaks(llm) -> None:
    """After a run every block is free and every reference count is zero."""
    bm = llm.scheduler.block_manager
    assert llm.is_finished()
    assert len(bm.free_block_ids) == len(bm.blocks) and not bm.used_block_ids
    assert all(b.ref_count == 0 for b in bm.blocks)


def run_engine(path: str, prompts, sampling_params, **kw):
    """(outputs, engine) of one generate on a fresh engine (ENGINE's settings, then ``kw``), checked
    for leaked blocks; the engine is shut down."""
    from nanovllm import LLM
    llm = LLM(path, **{**ENGINE, **kw})
    try:
        outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
        assert_no_leaks(llm)
        return outputs, llm
    finally:
        llm.exit()


def generate_with_features(path: str, prompts, n: int, check=None):
    """(prompts, outputs): greedy outputs of ``prompts``, then of the last three extended by two
    tokens (finished last, so their blocks are still cached: prefix-cache hits), with chunked
    prefill (a 40-token budget) and preemption (a 40-block cache) forced on; ``check(llm)`` runs on
    the engine first. Checked for cache hits and leaked blocks; the returned prompts include the
    second wave's."""
    from nanovllm import LLM
    again = [p + [1, 2] for p in prompts[-3:]]
    llm = LLM(path, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=40,
              max_num_batched_tokens=40, device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    try:
        if check is not None:
            check(llm)
        outputs = (llm.generate(prompts, sp, use_tqdm=False)
                   + llm.generate(again, sp, use_tqdm=False))
        assert llm.scheduler.block_manager.num_cache_hits > 0
        assert_no_leaks(llm)
    finally:
        llm.exit()
    return prompts + again, outputs


def token_ids_of(outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def assert_prompt_logprobs(model, prompt: list[int], entries: list, k: int, tol: float = 1e-4):
    """vLLM's format (None for the first token, then {token id: logprob} of the actual token and the
    top k) with transformers' log_softmax of the full sequence's logits (float32) as the
    reference."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        entry, expected = entries[pos], ref[pos - 1]
        assert prompt[pos] in entry and len(entry) in (k, k + 1), (pos, entry)
        kth = float(expected.topk(k).values[-1]) if k else float("inf")
        for t, lp in entry.items():
            assert lp == pytest.approx(float(expected[t]), abs=tol), (pos, t)
            assert t == prompt[pos] or lp >= kth - tol, f"position {pos}: {t} is not in the top {k}"


def edited_checkpoint(src: str, dst, **config_changes) -> str:
    """A copy of checkpoint ``src`` at ``dst`` whose config.json has ``config_changes`` applied
    (e.g. intermediate_size doubled: the weights no longer match the config)."""
    import json
    import shutil
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update({k: v(config[k]) if callable(v) else v for k, v in config_changes.items()})
    with open(path, "w") as f:
        json.dump(config, f)
    return str(dst)
