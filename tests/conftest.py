"""Shared fixtures: tiny random Qwen3 checkpoints (built offline) and transformers as the oracle."""
from __future__ import annotations

import os
import random

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; the variable is read when a
# kernel module is imported, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_model import build_tiny_qwen3

# One near-tie rule everywhere: at the first position where nanovllm and
# transformers differ, a top-2 logit gap below this in transformers means the rest is not compared.
NEAR_TIE = 1e-4

CHECKPOINTS = {
    # name: build_tiny_qwen3 overrides
    "gqa2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "gqa1_tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
    "gqa4_hd128_sharded": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_shard_size="200KB",
                               rope_theta=1e6, num_hidden_layers=3),
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


# An explicit cache size (honoured on every device): on a GPU, engines that live side by side
# in the test process must not each claim gpu_memory_utilization of it.
ENGINE = dict(kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=512)


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
            self.models[key] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        return self.models[key]

    @torch.no_grad()
    def greedy(self, path: str, prompt: list[int], n: int, device: str = "cpu", dtype=torch.float32):
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


def assert_matches_oracle(oracle: Oracle, path: str, prompts, outputs, n: int, max_near_ties: int | None = None,
                          tie: float = NEAR_TIE, **kw) -> int:
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
        assert gap < tie, f"prompt {i} (len {len(prompt)}) differs at token {j}: {got[j]} vs {ref[j]}, gap {gap:.3g}"
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
