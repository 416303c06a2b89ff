"""Output assembly: a forward's sampled tokens on their way to the host, vLLM's logprob entries, and the
``RequestOutput`` objects that ``generate`` returns."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from nanovllm.engine.detokenizer import stop_holdback
from nanovllm.engine.sampling import PromptLogprobsBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.logprobs import FlatLogprobs, Logprob
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm.sampling_params import RequestOutputKind


def _logprob_entry(top_ids: list[int], top_values: list[float], k: int, token: int, logprob: float,
                   rank: int) -> dict[int, Logprob]:
    """vLLM's logprobs entry: the chosen (or actual) token first (its top-k rank if a tie), then the top k."""
    top = list(zip(top_ids[:k], top_values[:k]))
    entry = {token: Logprob(logprob, next((r for r, (t, _) in enumerate(top, 1) if t == token), rank))}
    for r, (t, v) in enumerate(top, 1):
        entry.setdefault(t, Logprob(v, r))
    return entry


def wait_for_event(event, alive: Callable[[], bool] | None = None, poll_s: float = 2e-4,
                   check_every_s: float = 0.05) -> None:
    """Returns once ``event`` has completed. With ``alive`` it polls, raising once ``alive()`` is False: a
    forward whose collectives wait for a dead NCCL rank never ends."""
    if alive is None:
        return event.synchronize()
    next_check = time.monotonic() + check_every_s
    while not event.query():
        if time.monotonic() >= next_check:
            if not alive():
                raise RuntimeError("a tensor-parallel worker died during a forward")
            next_check = time.monotonic() + check_every_s
        time.sleep(poll_s)


class ModelRunnerOutput:
    """One forward's sampled tokens (and logprobs), copied to pinned memory at once; ``result`` waits for them,
    so the host can launch the next forward first. ``host_work``: host work the device waits for."""

    def __init__(self, token_ids: torch.Tensor, logprobs, num_logprobs: list[int | None],
                 prompt: PromptLogprobsBatch | None = None, prompt_logprobs=None, host_work=()):
        self.num_logprobs, self.prompt, self.event, self.host_work = num_logprobs, prompt, None, list(host_work)
        tensors = [token_ids, *(logprobs or ()), *(prompt_logprobs or ())]
        if token_ids.is_cuda:
            tensors = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t, non_blocking=True)
                       for t in tensors]
            self.event = torch.cuda.current_stream().record_event()
        n = 4 if logprobs else 0
        self.token_ids, self.logprobs, self.prompt_logprobs = tensors[0], tensors[1:1 + n] or None, tensors[1 + n:]

    def result(self, alive: Callable[[], bool] | None = None
               ) -> tuple[list[int], list[dict[int, float] | None], list[tuple[int, list[dict]] | None]]:
        """(token ids; per sequence, a logprobs entry or None; per sequence, (first prompt position, entries) or
        None)."""
        for work in self.host_work:  # first: the device may be waiting for it
            work.wait()
        if self.event is not None:
            wait_for_event(self.event, alive)
        for work in self.host_work:
            work.check()
        token_ids = self.token_ids.tolist()
        logprobs, prompt_logprobs = [None] * len(token_ids), [None] * len(token_ids)
        if self.logprobs is not None:
            sampled, ranks, top_ids, top_values = (t.tolist() for t in self.logprobs)
            logprobs = [None if k is None else _logprob_entry(top_ids[i], top_values[i], k, token, sampled[i], ranks[i])
                        for i, (k, token) in enumerate(zip(self.num_logprobs, token_ids))]
        if self.prompt is not None:
            target, ranks, top_ids, top_values = (t.tolist() for t in self.prompt_logprobs)
            row = 0
            for i, span in enumerate(self.prompt.spans):
                if span is not None:
                    first, count, k = span
                    prompt_logprobs[i] = (first, [_logprob_entry(top_ids[r], top_values[r], k, self.prompt.targets[r],
                                                                 target[r], ranks[r]) for r in range(row, row + count)])
                    row += count
        return token_ids, logprobs, prompt_logprobs


def _entries(entries: list, tokenizer, sp):
    """A copy of logprob ``entries`` (the sequence's list grows), with each ``decoded_token`` ("" for an id past
    the tokenizer's vocabulary) unless ``detokenize=False``, flat with ``flat_logprobs``."""
    entries = list(entries)
    if tokenizer is not None and sp.detokenize:
        for token, lp in (item for entry in entries for item in (entry or {}).items()):
            if lp.decoded_token is None:
                piece = tokenizer.convert_ids_to_tokens(token)
                lp.decoded_token = "" if piece is None else tokenizer.convert_tokens_to_string([piece])
    return FlatLogprobs.of(entries) if sp.flat_logprobs else entries


def completion_output(seq: Sequence, index: int, tokenizer, detokenizer=None,
                      incremental: bool = False) -> CompletionOutput:
    """Completion ``index`` of its request. Its text leaves out a stop token's (vLLM's) and ends at a stop
    string; with ``incremental`` it is the detokenizer's so far."""
    sp = seq.sampling_params
    if tokenizer is None or not sp.detokenize:
        text = ""
    elif detokenizer is not None and (incremental or seq.finish_reason == "stop" and sp.stop_strings):
        text = detokenizer.text  # cut at the stop string
    else:
        by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
        ids = seq.completion_token_ids
        if by_token and not sp.include_stop_str_in_output:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
    logprobs = cumulative = None
    if sp.logprobs is not None:
        cumulative = float(sum(entry[token] for entry, token in zip(seq.logprobs, seq.completion_token_ids)))
        logprobs = _entries(seq.logprobs, tokenizer, sp)
    return CompletionOutput(index, text, seq.completion_token_ids, cumulative, logprobs, seq.finish_reason,
                            seq.stop_reason)


def request_output(request, tokenizer) -> RequestOutput:
    """vLLM's ``RequestOutput`` of a request (its n completions so far; ``finished`` once all have ended)."""
    first = request.seqs[0]
    arrival = first.arrival_time
    first_token = min((s.first_token_time for s in request.seqs if s.first_token_time is not None), default=None)
    finished = all(s.finish_time is not None for s in request.seqs)
    finish_time = max(s.finish_time for s in request.seqs) if finished else None
    metrics = RequestMetrics(arrival, first_token, finish_time,
                             None if first_token is None else first_token - arrival,
                             None if finish_time is None else finish_time - arrival)
    prompt_logprobs = None
    if first.prompt_logprobs is not None:
        prompt_logprobs = _entries(first.prompt_logprobs, tokenizer, first.sampling_params)
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, prompt_logprobs,
                         [completion_output(seq, i, tokenizer, request.detokenizers[i], request.incremental_text)
                          for i, seq in enumerate(request.seqs)], finished,
                         first.num_prefix_cached_tokens or 0, metrics, request.error)


def step_output(request, tokenizer) -> RequestOutput | None:
    """What ``LLMEngine.step`` reports of a request by its ``output_kind``: None while nothing is new (FINAL_ONLY:
    until it finishes); DELTA: what is new since the last report (the prompt logprobs in the first)."""
    kind = request.seqs[0].sampling_params.output_kind
    count = sum(seq.num_completion_tokens for seq in request.seqs)
    if not request.finished and (count == request.num_reported or kind is RequestOutputKind.FINAL_ONLY):
        return None
    output = request_output(request, tokenizer)
    if kind is RequestOutputKind.DELTA:
        output.prompt_logprobs = None if request.num_reported else output.prompt_logprobs
        output.outputs = [_delta(request, i, out) for i, out in enumerate(output.outputs)]
    request.num_reported = count
    return output


def _delta(request, i: int, out: CompletionOutput) -> CompletionOutput:
    """Completion ``i``'s part not reported yet, its text held back as a stream's is."""
    tokens, chars = request.reported[i]
    holdback = stop_holdback(request.seqs[i].sampling_params.stop_strings, bool(out.finish_reason))
    end = max(chars, len(out.text) - holdback)
    request.reported[i] = (len(out.token_ids), end)
    return replace(out, text=out.text[chars:end], token_ids=out.token_ids[tokens:],
                   logprobs=None if out.logprobs is None else out.logprobs[tokens:])
