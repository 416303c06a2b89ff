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


def encode(tokenizer, what: str, text: str, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids; text that UTF-8 cannot encode (a lone surrogate) is refused naming ``what``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: {e.reason} {text[e.start]!r} at index {e.start}") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


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
        prompt = encode(tokenizer, f"prompt {i}", prompt)
    elif not isinstance(prompt, (list, tuple)) or not all(type(t) is int for t in prompt):
        raise TypeError(f"prompt {i} must be a string, a list of ints or a dict, got {prompt!r:.80}")
    # vLLM's wording (which scripts match), then our values
    if not prompt:
        raise ValueError(f"prompt {i}: the decoder prompt cannot be empty")
    vocab_size = config.hf_config.vocab_size
    if bad := [t for t in prompt if not 0 <= t < vocab_size]:
        raise ValueError(f"prompt {i}: token id {bad[0]} is out of vocabulary "
                         f"(ids {bad[:5]} outside [0, {vocab_size}))")
    if len(prompt) >= config.max_model_len:
        capacity = config.num_kvcache_blocks * config.kvcache_block_size
        cache = f" (the whole KV cache holds {capacity} tokens)" if capacity == config.max_model_len else ""
        raise ValueError(f"prompt {i} (length {len(prompt)}) plus at least 1 output token is longer than the maximum "
                         f"context length: max_model_len={config.max_model_len}{cache}")
    return list(prompt), text
