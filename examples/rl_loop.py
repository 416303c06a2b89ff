"""A GRPO-style RL loop on CPU: `python examples/rl_loop.py [--steps 20]`.

It trains the shipped demo model (`nanovllm:demo`, a tiny Qwen3 trained on the Python standard
library) to complete a function header with code that parses and defines a function. Each step:

1. rollouts: nanovllm samples `--n` completions of every prompt (temperature 1, stopped at a blank
   line) with the sampled tokens' logprobs;
2. reward: 1 when `ast.parse(prompt + completion)` succeeds and the tree defines a function, else 0;
3. advantages: each completion's reward minus its group's mean, over the group's standard deviation;
4. a clipped policy-gradient step on a transformers copy of the model (the engine's logprobs are the
   old policy's: the ratio starts at 1, and the largest gap to the trainer's own logprobs is shown);
5. `llm.update_weights(model.named_parameters())` pushes the new weights into the engine, in place.

With `--sleep` (the default), the engine sleeps while the trainer works (`sleep(level=2)`: its
weights and KV cache given back), then wakes its weights, takes the update and wakes its KV cache:
the pattern that frees the device for the trainer on a GPU. The mean reward rises over the steps (a
progress bar shows it).
"""
from __future__ import annotations

import argparse
import ast
import time

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "def is_prime(n):",
    "def read_lines(path):",
    "def merge(a, b):",
    "def parse_args(argv):",
    "class Stack:\n    def push(self, item):",
    "def flatten(items):",
    "def count_words(text):",
]


def reward(prompt: str, completion: str) -> float:
    """1.0 when prompt + completion is Python that parses and defines a function, else 0.0."""
    try:
        tree = ast.parse(prompt + completion)
    except (SyntaxError, ValueError):
        return 0.0
    return float(any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     for node in ast.walk(tree)))


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[prompts, n] rewards -> each minus its group's mean, over the group's std (0 where all are
    equal)."""
    centered = rewards - rewards.mean(1, keepdim=True)
    return centered / (rewards.std(1, keepdim=True) + 1e-4)


def rollout_batch(outputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                    list[tuple[str, str]]]:
    """(token ids [B, T] right-padded with -1, the completion mask [B, T - 1] over next-token
    positions, the engine's logprobs of those tokens [B, T - 1], (prompt, completion text) per
    row)."""
    rows, masks, old, texts = [], [], [], []
    for output in outputs:
        for completion in output.outputs:
            prompt_ids, ids = list(output.prompt_token_ids), list(completion.token_ids)
            rows.append(prompt_ids + ids)
            masks.append([0.0] * (len(prompt_ids) - 1) + [1.0] * len(ids))
            old.append([0.0] * (len(prompt_ids) - 1) +
                       [entry[token].logprob for entry, token in zip(completion.logprobs, ids)])
            texts.append((output.prompt, completion.text))
    width = max(map(len, rows))
    ids = torch.tensor([row + [-1] * (width - len(row)) for row in rows])
    mask = torch.tensor([m + [0.0] * (width - 1 - len(m)) for m in masks])
    old_logprobs = torch.tensor([o + [0.0] * (width - 1 - len(o)) for o in old])
    return ids, mask, old_logprobs, texts


def policy_step(model, optimizer, ids, mask, old_logprobs, advantages, clip: float) -> float:
    """One clipped policy-gradient step (PPO's surrogate, token mean); the largest
    |trainer - engine| logprob gap, measured before the step."""
    real = ids >= 0
    logits = model(ids.clamp(min=0), attention_mask=real.long()).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None].clamp(min=0))[..., 0]
    gap = float(((logprobs.detach() - old_logprobs) * mask).abs().max())
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    loss = -(surrogate * mask).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return gap


def train(steps: int = 20, n: int = 8, num_prompts: int = len(PROMPTS), max_tokens: int = 32,
          lr: float = 3e-4, clip: float = 0.2, seed: int = 0, sleep: bool = True,
          threads: int | None = None,
          progress: bool = True) -> tuple[list[float], list[float]]:
    """Runs the loop; per step, the mean reward of its rollouts and the largest gap between the
    engine's sampled logprobs and the trainer's own (the same weights: float rounding only)."""
    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    prompts = PROMPTS[:num_prompts]
    llm = LLM("nanovllm:demo", device="cpu", max_num_seqs=n * len(prompts), max_model_len=256,
              enable_sleep_mode=sleep, seed=seed)
    try:
        # the trainer's copy, in float32 (the engine's dtype on CPU);
        # tied embeddings: no lm_head.weight pushed
        model = AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        history, gaps = [], []
        bar = tqdm(range(steps), desc="GRPO", disable=not progress, dynamic_ncols=True)
        for step in bar:
            params = [SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, stop=["\n\n"],
                                     logprobs=0,
                                     seed=(seed * 100003 + step * len(prompts) + i) * n)
                      for i in range(len(prompts))]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            ids, mask, old_logprobs, texts = rollout_batch(outputs)
            rewards = torch.tensor([reward(p, c) for p, c in texts]).view(len(prompts), n)
            history.append(float(rewards.mean()))
            if sleep:
                llm.sleep(level=2)  # the trainer's turn: the engine gives its memory back
            gap = policy_step(model, optimizer, ids, mask, old_logprobs,
                              group_advantages(rewards).view(-1), clip)
            if sleep:
                llm.wake_up(tags=["weights"])  # zeroed: the update fills them
            llm.update_weights(model.named_parameters())
            if sleep:
                llm.wake_up(tags=["kv_cache"])
            gaps.append(gap)
            bar.set_postfix(reward=f"{history[-1]:.2f}", logprob_gap=f"{gap:.1e}")
        return history, gaps
    finally:
        llm.exit()
        torch.set_num_threads(threads_before)


def positive(text: str) -> int:
    """An argparse type: an int >= 1 (argparse names the flag when this refuses)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive, default=20)
    parser.add_argument("--n", type=positive, default=8,
                        help="completions per prompt (a GRPO group)")
    parser.add_argument("--prompts", type=positive, default=len(PROMPTS),
                        help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--max-tokens", type=positive, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--clip", type=float, default=0.2, help="PPO's ratio clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sleep", dest="sleep", action="store_false",
                        help="keep the engine awake while training")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's CPU threads (0: torch's default; on a busy machine more "
                        "threads wait on each other: 1 is fastest for this tiny model)")
    args = parser.parse_args()
    start = time.perf_counter()
    history, gaps = train(args.steps, args.n, args.prompts, args.max_tokens, args.lr, args.clip,
                          args.seed, args.sleep, args.threads)
    k = max(1, len(history) // 4)
    print(f"mean reward: first {k} steps {sum(history[:k]) / k:.3f}, "
          f"last {k} steps {sum(history[-k:]) / k:.3f}")
    print("per step:", " ".join(f"{r:.2f}" for r in history))
    print(f"largest |engine - trainer| logprob of a sampled token: {max(gaps):.1e}")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
