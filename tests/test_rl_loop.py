"""examples/rl_loop.py, short: eight GRPO steps on the demo model raise the mean reward (the last
three steps' mean well above the first two's), and the engine's sampled logprobs equal the trainer's
on the same weights."""
from __future__ import annotations

import importlib.util
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example():
    spec = importlib.util.spec_from_file_location("rl_loop",
                                                  os.path.join(ROOT, "examples", "rl_loop.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_and_advantages():
    rl_loop = load_example()
    assert rl_loop.reward("def f(x):", "\n    return x\n") == 1.0
    assert rl_loop.reward("def f(x):", "\n    return (x\n") == 0.0  # does not parse
    assert rl_loop.reward("", "x = 1\n") == 0.0  # parses, defines no function
    adv = rl_loop.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    assert adv[0, 0] > 0 and torch.equal(adv[0], adv[0, 0] * torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert adv[1].abs().max() == 0  # one reward for the whole group: nothing to learn from


def test_short_rl_loop_raises_the_reward():
    """Seeded, on one thread (many threads on a busy machine wait on each other: 20 times slower
    here)."""
    rl_loop = load_example()
    rewards, gaps = rl_loop.train(steps=8, num_prompts=4, threads=1, progress=False)
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    assert last > first + 0.25, f"rewards per step: {rewards}"
    assert max(gaps) < 1e-4, f"engine vs trainer logprob gaps: {gaps}"


def test_flags_below_one_are_refused_naming_the_flag():
    import subprocess
    import sys
    for flag in ("--steps", "--n", "--prompts", "--max-tokens"):
        for value in ("0", "-1"):
            out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "rl_loop.py"),
                                  flag, value], capture_output=True, text=True, timeout=60)
            assert out.returncode == 2 and f"argument {flag}: must be >= 1" in out.stderr, \
                out.stderr
