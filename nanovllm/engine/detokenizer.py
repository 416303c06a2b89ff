"""Incremental detokenization of a growing completion, holding back a token that ends inside a UTF-8
character; for stop strings and streaming."""
from __future__ import annotations

CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the completion, for the first word's spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.tokens)
        self.text = ""
        self.sent = 0  # how much of text take() has handed out

    def _unread(self) -> str:
        """The text of the tokens from read_offset on (decoded after those from prefix_offset)."""
        start, decode = self.prefix_offset, self.tokenizer.decode
        before = decode(self.tokens[start:self.read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        return decode(self.tokens[start:],
                      skip_special_tokens=self.skip_special_tokens)[len(before):]

    def add(self, token_id: int) -> str:
        """Appends one completion token; returns the text it completes ("" while a character
        is open)."""
        self.tokens.append(token_id)
        delta = self._unread()
        if not delta or delta.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back."""
        rest = self._unread()
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += rest
        return rest

    def take(self, holdback: int = 0) -> str:
        """The text not handed out yet, less its last ``holdback`` characters."""
        end = max(self.sent, len(self.text) - holdback)
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def find_stop(self, stops: tuple[str, ...], delta: str) -> tuple[int, str] | None:
        """(where in ``text``, which) of the earliest stop string that ``delta`` completed."""
        if not delta:
            return None
        start = max(0, len(self.text) - len(delta) - max(len(s) for s in stops) + 1)
        hits = [(i, s) for s in stops if (i := self.text.find(s, start)) != -1]
        return min(hits) if hits else None


def stop_holdback(stops: tuple[str, ...], finished: bool) -> int:
    """How many trailing characters a stream holds back: those that could still begin a stop
    string."""
    return 0 if finished or not stops else max(map(len, stops)) - 1
