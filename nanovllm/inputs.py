"""vLLM's prompt types, plain dicts (``generate`` also takes strings and token-id lists)."""
from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
