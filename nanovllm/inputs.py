"""vLLM's prompt types (plain dicts) and the check of a prompt against an engine."""
from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


def require_tokenizer(tokenizer, what: str):
    if tokenizer is None:
        raise ValueError(f"{what} need a tokenizer, but the engine has skip_tokenizer_init=True")


def parse_prompt(i: int, prompt, tokenizer, config) -> tuple[list[int], str | None]:
    """Prompt ``i``'s token ids, checked against the engine's ``config``, and its text (None for token ids)."""
    if isinstance(prompt, dict):
        if unknown := sorted(set(prompt) - {"prompt", "prompt_token_ids"}):
            raise ValueError(f"prompt {i} has unsupported keys {unknown}")
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
            if not isinstance(prompt, (list, tuple)):  # a string here is not to be tokenized
                raise TypeError(f"prompt {i}'s prompt_token_ids must be a list of ints, got {prompt!r:.80}")
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise TypeError(f"prompt {i}'s 'prompt' must be a string, got {prompt!r:.80}")
        else:
            raise ValueError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids'")
    text = prompt if isinstance(prompt, str) else None
    if text is not None:
        require_tokenizer(tokenizer, "string prompts (pass token ids instead)")
        prompt = tokenizer.encode(prompt)
    elif not isinstance(prompt, (list, tuple)) or not all(type(t) is int for t in prompt):
        raise TypeError(f"prompt {i} must be a string, a list of ints or a dict, got {prompt!r:.80}")
    if not prompt:
        raise ValueError(f"prompt {i} is empty")
    vocab_size = config.hf_config.vocab_size
    if bad := [t for t in prompt if not 0 <= t < vocab_size]:
        raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= config.max_model_len:
        capacity = config.num_kvcache_blocks * config.kvcache_block_size
        cache = f" (the whole KV cache holds {capacity} tokens)" if capacity == config.max_model_len else ""
        raise ValueError(f"prompt {i} has {len(prompt)} tokens; max_model_len={config.max_model_len}{cache} "
                         "leaves no room for output")
    return list(prompt), text
