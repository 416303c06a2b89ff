"""Stop conditions: whether a token just appended ends its sequence, and the text a stream may show of it."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanovllm.engine.detokenizer import IncrementalDetokenizer, stop_holdback
from nanovllm.engine.sequence import Sequence


@dataclass
class Request:
    """One prompt and its ``n`` completions."""

    index: int
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    request_id: str = ""
    prompt: str | None = None        # when it was given as text
    detokenizers: list[IncrementalDetokenizer | None] = field(default_factory=list)  # per completion
    stream: deque | None = None      # the pieces its stream() call has not yielded yet
    incremental_text: bool = False   # its outputs' text is its detokenizers' (step() reports it often)
    num_reported: int = 0            # completion tokens step() has reported
    reported: list = field(default_factory=list)  # per completion, the (tokens, characters) reported (DELTA)
    error: str | None = None         # why a completion ended with finish_reason "error"

    def __post_init__(self):
        self.detokenizers = self.detokenizers or [None] * len(self.seqs)
        self.reported = self.reported or [(0, 0)] * len(self.seqs)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class OutputProcessor:
    def __init__(self, eos_token_ids, max_model_len: int):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None  # the model's own
        self.max_model_len = max_model_len

    def check_stop(self, request: Request, seq: Sequence, token_id: int) -> tuple[str, int | str | None] | None:
        """(finish reason, stop reason) if ``token_id``, just appended, ends ``seq``, else None, in vLLM's order:
        length, a stop token once ``min_tokens`` are out, a stop string (the text is cut there). Queues the text
        a stream may show (all but what could still begin a stop string)."""
        sp, detok = seq.sampling_params, request.detokenizers[request.seqs.index(seq)]
        num_out = len(seq.token_ids) - seq.num_prompt_tokens
        stops = sp.stop_strings
        reason = stop_reason = hit = None
        if num_out >= sp.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        elif num_out >= sp.min_tokens and not sp.ignore_eos and token_id in self.eos_token_ids:
            # generation_config's other EOS ids are stop tokens to vLLM
            reason, stop_reason = "stop", None if token_id == self.eos_token_id else token_id
        elif num_out >= sp.min_tokens and token_id in sp.stop_token_ids:
            reason, stop_reason = "stop", token_id
        # a stop token's text is output only with include_stop_str_in_output (vLLM's)
        counts = detok is not None and (reason != "stop" or sp.include_stop_str_in_output)
        delta = detok.add(token_id) if counts else ""
        if stops and reason != "stop" and num_out > sp.min_tokens and (hit := detok.find_stop(stops, delta)):
            at, stop = hit
            detok.text = detok.text[:at + len(stop) if sp.include_stop_str_in_output else at]
            reason, stop_reason = "stop", stop
        text = ""  # detokenize=False
        if detok is not None:
            if reason and not hit:
                detok.flush()
            text = detok.take(stop_holdback(stops, bool(reason)))
        self.stream_piece(request, seq, text, [token_id], reason)
        return (reason, stop_reason) if reason else None

    @staticmethod
    def stream_piece(request: Request, seq: Sequence, text: str, token_ids: list[int], reason: str | None = None):
        if request.stream is not None:
            request.stream.append({"index": request.index, "output_index": request.seqs.index(seq), "text": text,
                                   "token_ids": token_ids, "finished": reason is not None or seq.is_finished,
                                   "finish_reason": reason or seq.finish_reason})
