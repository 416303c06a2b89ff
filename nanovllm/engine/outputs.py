"""Requests, their stop checks, sampled tokens on their way to the host, and ``RequestOutput``s."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanovllm.engine.cuda_graph import wait_for_event
from nanovllm.engine.detokenizer import IncrementalDetokenizer, stop_holdback
from nanovllm.engine.logprobs import (
    PromptLogprobsBatch,
    entries_out,
    logprob_entries,
    prompt_logprob_entries,
)
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class Request:
    """One prompt and its ``n`` completions (``seqs``, ``detokenizers``, ``reported``: one each)."""
    index: int
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    request_id: str = ""
    prompt: str | None = None  # when it was given as text
    detokenizers: list[IncrementalDetokenizer | None] = field(default_factory=list)
    stream: deque | None = None  # the pieces its stream() call has not yielded yet
    incremental_text: bool = False  # its outputs' text is its detokenizers' (step() reports often)
    num_reported: int = 0  # completion tokens step() has reported
    reported: list = field(default_factory=list)  # per completion: (tokens, characters) for DELTA
    error: str | None = None  # why a completion ended with finish_reason "error"

    def __post_init__(self):
        self.detokenizers = self.detokenizers or [None] * len(self.seqs)
        self.reported = self.reported or [(0, 0)] * len(self.seqs)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class OutputProcessor:
    def __init__(self, eos_token_ids, max_model_len: int):
        self.eos_token_ids, self.max_model_len = frozenset(eos_token_ids), max_model_len
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None  # the model's own

    def check_stop(self, request: Request, seq: Sequence, token_id: int
                   ) -> tuple[str, int | str | None] | None:
        """(finish reason, stop reason) if ``token_id`` ends ``seq``; queues the streamable text."""
        sp, detok = seq.sampling_params, request.detokenizers[request.seqs.index(seq)]
        num_out, stops = len(seq.token_ids) - seq.num_prompt_tokens, sp.stop_strings
        reason = stop_reason = hit = None
        if num_out >= sp.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        elif num_out >= sp.min_tokens and not sp.ignore_eos and token_id in self.eos_token_ids:
            reason, stop_reason = "stop", None if token_id == self.eos_token_id else token_id
        elif num_out >= sp.min_tokens and token_id in sp.stop_token_ids:
            reason, stop_reason = "stop", token_id
        counts = detok is not None and (reason != "stop" or sp.include_stop_str_in_output)
        delta = detok.add(token_id) if counts else ""
        if (stops and reason != "stop" and num_out > sp.min_tokens
                and (hit := detok.find_stop(stops, delta))):
            at, stop = hit
            detok.text = detok.text[:at + len(stop) if sp.include_stop_str_in_output else at]
            reason, stop_reason = "stop", stop
        if detok is not None and reason and not hit:
            detok.flush()
        text = "" if detok is None else detok.take(stop_holdback(stops, bool(reason)))
        self.stream_piece(request, seq, text, [token_id], reason)
        return (reason, stop_reason) if reason else None

    @staticmethod
    def stream_piece(request: Request, seq: Sequence, text: str, token_ids: list[int],
                     reason: str | None = None):
        if request.stream is not None:
            request.stream.append({"index": request.index, "output_index": request.seqs.index(seq),
                                   "text": text, "token_ids": token_ids,
                                   "finished": reason is not None or seq.is_finished,
                                   "finish_reason": reason or seq.finish_reason})


class ModelRunnerOutput:
    """A forward's sampled tokens, copied to pinned memory at once; ``result`` waits for them."""

    def __init__(self, token_ids: torch.Tensor, logprobs, num_logprobs: list[int | None],
                 prompt: PromptLogprobsBatch | None = None, prompt_logprobs=None, host_work=()):
        self.num_logprobs, self.prompt, self.host_work = num_logprobs, prompt, list(host_work)
        tensors = [token_ids, *(logprobs or ()), *(prompt_logprobs or ())]
        if token_ids.is_cuda:
            tensors = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                       .copy_(t, non_blocking=True) for t in tensors]
        self.event = torch.cuda.current_stream().record_event() if token_ids.is_cuda else None
        n = 4 if logprobs else 0
        self.token_ids, self.logprobs = tensors[0], tensors[1:1 + n] or None
        self.prompt_logprobs = tensors[1 + n:]

    def result(self, alive: Callable[[], bool] | None = None) -> tuple[
            list[int], list[dict[int, float] | None], list[tuple[int, list[dict]] | None]]:
        """Token ids, then per sequence a logprobs entry and (first prompt position, entries)."""
        for work in self.host_work:  # host work first: the device may be waiting for it
            work.wait()
        if self.event is not None:
            wait_for_event(self.event, alive)
        for work in self.host_work:
            work.check()
        token_ids = self.token_ids.tolist()
        logprobs = ([None] * len(token_ids) if self.logprobs is None
                    else logprob_entries(self.logprobs, self.num_logprobs, token_ids))
        prompt_logprobs = ([None] * len(token_ids) if self.prompt is None
                           else prompt_logprob_entries(self.prompt, self.prompt_logprobs))
        return token_ids, logprobs, prompt_logprobs


def completion_output(seq: Sequence, index: int, tokenizer, detokenizer=None,
                      incremental: bool = False) -> CompletionOutput:
    """Text: no stop token's, cut at a stop string; ``incremental``: the detokenizer's so far."""
    sp, stopped = seq.sampling_params, seq.finish_reason == "stop"
    if tokenizer is None or not sp.detokenize:
        text = ""
    elif detokenizer is not None and (incremental or stopped and sp.stop_strings):
        text = detokenizer.text  # cut at the stop string
    else:
        cut = stopped and not isinstance(seq.stop_reason, str) and not sp.include_stop_str_in_output
        ids = seq.completion_token_ids[:-1] if cut else seq.completion_token_ids
        text = tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
    logprobs = cumulative = None
    if sp.logprobs is not None:
        cumulative = float(sum(e[t] for e, t in zip(seq.logprobs, seq.completion_token_ids)))
        logprobs = entries_out(seq.logprobs, tokenizer, sp)
    return CompletionOutput(index, text, seq.completion_token_ids, cumulative, logprobs,
                            seq.finish_reason, seq.stop_reason)


def request_output(request, tokenizer) -> RequestOutput:
    """vLLM's ``RequestOutput`` of a request: its completions so far, ``finished`` once all end."""
    seqs, first = request.seqs, request.seqs[0]
    arrival = first.arrival_time
    first_token = min((s.first_token_time for s in seqs if s.first_token_time is not None),
                      default=None)
    finished = all(s.finish_time is not None for s in seqs)
    finish_time = max(s.finish_time for s in seqs) if finished else None
    metrics = RequestMetrics(arrival, first_token, finish_time,
                             None if first_token is None else first_token - arrival,
                             None if finish_time is None else finish_time - arrival)
    prompt_logprobs = (None if first.prompt_logprobs is None
                       else entries_out(first.prompt_logprobs, tokenizer, first.sampling_params))
    completions = [completion_output(seq, i, tokenizer, request.detokenizers[i],
                                     request.incremental_text) for i, seq in enumerate(seqs)]
    output = RequestOutput.__new__(RequestOutput)  # by the dataclass's own __init__: the public
    RequestOutput.__init__.__wrapped__(  # one also drops a later vLLM's keywords, never given here
        output, request.request_id, request.prompt, request.prompt_token_ids, prompt_logprobs,
        completions, finished, first.num_prefix_cached_tokens or 0, metrics, request.error)
    return output
