"""Structured outputs on rank 0: constraints compiled by xgrammar (the ``structured`` extra; vLLM's default
backend), one grammar matcher per constrained sequence, and each step's token bitmask.

The bitmask is filled on the host (one int32 row of ``ceil(vocab / 32)`` words per sequence of the step, bit t
set where token t is allowed; free rows all ones) and applied to the logits on the device by the sampler
(``layers.sampler.apply_token_bitmask``), before every other stage. A step without constrained sequences has
no bitmask and pays nothing. A matcher accepts exactly a sequence's known completion tokens: it is advanced
when a token is appended (``EngineCore._finish_inflight``), so preemption, which recomputes known tokens,
leaves it as it is. Its stop tokens are the engine's EOS ids: EOS is allowed exactly where the output is
complete, and accepting it terminates the matcher.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger("nanovllm")
# xgrammar's C++ errors begin with a time and a source location: "[19:07:16] /project/cpp/x.cc:94: "
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# a step's bitmask rows are filled by up to FILL_THREADS threads, each taking at least FILL_MIN_ROWS rows, by
# FILL_METHOD, one of FILL_METHODS: "batch", xgrammar's BatchGrammarMatcher (one call, its own C++ threads, the
# GIL let go once); "pool", our thread pool, each thread calling the matchers' fill row by row (xgrammar's fill
# lets go of the GIL; the caller's thread is one of them). tools/bench_fill.py on the H200 host (16 cores), 64
# JSON-schema rows at Qwen3's vocabulary: one thread 9.4 ms, batch 2.3 ms and pool 3.0 ms with 8 threads
FILL_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
FILL_MIN_ROWS = 4
FILL_METHODS = ("batch", "pool")
FILL_METHOD = "batch"
# how a step's tokens advance the matchers (accept_tokens), one of ACCEPT_METHODS: one call a matcher ("loop") or
# one call for all ("batch"); on this CPU machine, 64 JSON-schema matchers at Qwen3's vocabulary, 0.34 ms a loop
# against 0.46 ms a batch call
ACCEPT_METHODS = ("loop", "batch")
ACCEPT_METHOD = "loop"
# compiled grammars kept, least recently used dropped first, up to this many and this many bytes (one holds
# masks over the whole vocabulary; vLLM bounds xgrammar's cache at 512 MB too)
CACHE_SIZE = 256
CACHE_BYTES = 512 * 2 ** 20


def import_xgrammar():
    """The xgrammar module, or a ValueError saying how to install it."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured_outputs needs xgrammar, nanovllm's optional extra: pip install -e "
                         "'.[structured]' (or pip install xgrammar)") from e
    return xgrammar


def _size(compiled) -> int:
    """A compiled grammar's bytes (xgrammar's count; 0 from a version without it)."""
    return getattr(compiled, "memory_size_bytes", 0)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose strings are exactly ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammar:
    """One sequence's matcher: it has accepted the sequence's known completion tokens, in order."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_accepted = 0

    def refused(self, token_id: int) -> RuntimeError:
        """The error of a token the grammar refuses (``accept_tokens``): it was sampled under this matcher's
        mask, so it never should be."""
        return RuntimeError(f"the grammar refused token {token_id} after {self.num_accepted} accepted tokens")

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class StructuredOutputManager:
    """Rank 0's structured outputs: the compiler (made on the first constrained request: reading the
    vocabulary takes a while), compiled grammars cached per constraint, matchers, bitmasks."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        """``vocab_size``: the model's (the logits' width), which may exceed the tokenizer's; ids past the
        tokenizer's are never allowed."""
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.compiler = None
        self.cache: OrderedDict[tuple, object] = OrderedDict()  # (what, spec, any_whitespace) -> CompiledGrammar
        self.cache_bytes = 0
        self.lock = threading.Lock()           # admissions compile from the callers' threads
        self.fill_seconds = 0.0                # in fill_rows (xgrammar), since the engine started

    def _compiler(self):
        if self.compiler is None:
            xgr = import_xgrammar()
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer, but the engine has skip_tokenizer_init=True")
            if not self.eos_token_ids:
                raise ValueError("structured_outputs need an EOS token to end an output, and the model has none")
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # our cache, keyed by the constraint
        return self.compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of a constraint, from the cache when it was compiled before; a constraint that
        does not compile raises ``ValueError`` naming the field and xgrammar's reason."""
        kind = params.kind
        spec = {"json": lambda: params.json if isinstance(params.json, str) else json.dumps(params.json),
                "json_object": lambda: '{"type": "object"}', "regex": lambda: params.regex,
                "grammar": lambda: params.grammar, "choice": lambda: choice_grammar(params.choice)}[kind]()
        if kind == "grammar" and "::=" not in spec:  # vLLM would take it for a Lark grammar
            raise ValueError("structured_outputs.grammar must be xgrammar's EBNF (rules `name ::= ...`, one of them "
                             f"`root`); Lark grammars are not supported, got {spec!r:.80}")
        # keyed by what xgrammar compiles: a choice is the grammar choice_grammar writes, json_object a schema
        key = ({"json_object": "json", "choice": "grammar"}.get(kind, kind), spec, not params.disable_any_whitespace)
        with self.lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                self.cache.move_to_end(key)
                return compiled
            compiler = self._compiler()
            try:
                if key[0] == "json":
                    compiled = compiler.compile_json_schema(spec, any_whitespace=key[2])
                elif key[0] == "regex":
                    compiled = compiler.compile_regex(spec)
                else:
                    compiled = compiler.compile_grammar(spec)
            except Exception as e:  # xgrammar raises RuntimeError (and its own errors) from C++
                reason = _XGR_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"structured_outputs.{kind} does not compile: {reason}") from None
            self.cache[key] = compiled
            self.cache_bytes += _size(compiled)
            while len(self.cache) > 1 and (len(self.cache) > CACHE_SIZE or self.cache_bytes > CACHE_BYTES):
                self.cache_bytes -= _size(self.cache.popitem(last=False)[1])
            return compiled

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher (a new completion) of the constraint."""
        return Grammar(import_xgrammar().GrammarMatcher(self.compile(params), override_stop_tokens=self.eos_token_ids))

    def grammar_bitmask(self, seqs: list[Sequence], rows: list[int], pin_memory: bool = False) -> torch.Tensor | None:
        """The step's bitmask on the host ([len(seqs), ceil(vocab / 32)] int32), or None when no sequence of
        ``rows`` (those whose sampled token is kept) is constrained. A sequence that has finished meanwhile
        (its token in flight ended it) gets a free row: its token is dropped anyway."""
        prepared = self._prepare_bitmask(seqs, rows, pin_memory)
        return None if prepared is None else self._fill(*prepared)

    def grammar_bitmask_async(self, seqs: list[Sequence], rows: list[int], pin_memory: bool = False, skip=(),
                              out: torch.Tensor | None = None, done=None) -> Future | None:
        """``grammar_bitmask``, its fill in a background thread (xgrammar lets go of the GIL there, so the caller
        goes on meanwhile): a Future of the bitmask, or None when no row is constrained. It may be called before
        the stop checks of the tokens just accepted: a row whose matcher has ended (it took EOS) or whose sequence
        is in ``skip`` (its grammar refused its token) is left free, and the row of a sequence about to end is
        filled and then unused. ``out``: a buffer whose first rows take the bitmask (else a new one); ``done()`` is
        called once the fill has ended, whether it failed or not. Until the Future is done the caller must not
        advance these sequences' matchers, nor start another fill."""
        prepared = self._prepare_bitmask(seqs, rows, pin_memory, skip, out)
        if prepared is None:
            return None
        try:
            return _background().submit(self._fill, *prepared, done)
        except RuntimeError:  # the interpreter is exiting (a generate() on a thread the main thread left behind):
            result = Future()   # concurrent.futures takes no new work then, so the fill is done here
            result.set_result(self._fill(*prepared, done))
            return result

    def _prepare_bitmask(self, seqs: list[Sequence], rows: list[int], pin_memory: bool, skip=(), out=None):
        """The bitmask (``out``'s first rows, or a new one) with its free rows set, and the (row, matcher) pairs
        left to fill; None if there are none."""
        constrained = [row for row in rows if seqs[row].grammar is not None and not seqs[row].is_finished
                       and seqs[row] not in skip and not seqs[row].grammar.is_terminated]
        if not constrained:
            return None
        xgr = import_xgrammar()
        shape = xgr.get_bitmask_shape(len(seqs), self.vocab_size)
        # not torch.full: its fill of the whole buffer is a parallel region of torch's CPU threads, and with it
        # the H200 host's fill took 5.5 ms a step against 1.1 without (likely those threads spinning on the
        # fill's cores); a free row is set alone, below torch's grain size
        bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=pin_memory) if out is None else out[:shape[0]]
        for row in set(range(len(seqs))).difference(constrained):
            bitmask[row].fill_(-1)
        for row in constrained:  # the matcher must have accepted every known completion token, none more
            seq = seqs[row]
            if seq.grammar.num_accepted != len(seq.token_ids) - seq.num_prompt_tokens:  # an engine bug, never input
                raise RuntimeError(f"sequence {seq.seq_id}'s grammar accepted {seq.grammar.num_accepted} tokens of "
                                   f"its {len(seq.token_ids) - seq.num_prompt_tokens}")
        return bitmask, [(row, seqs[row].grammar.matcher) for row in constrained]

    def _fill(self, bitmask: torch.Tensor, rows: list[tuple[int, object]], done=None) -> torch.Tensor:
        start = time.perf_counter()
        try:
            fill_rows(rows, bitmask)
        finally:
            self.fill_seconds += time.perf_counter() - start
            if done is not None:
                done()
        return bitmask


class BitmaskHandoff:
    """A constrained step's bitmask on its way to the sampler while the host goes on (one rank, async scheduling).
    The sampler is launched at once, behind a wait on the device for a flag in pinned host memory
    (``triton_sampler.wait_for_flag``) and a copy of one pinned host buffer to the device; the fill, in a thread,
    writes that buffer and then raises the flag to the step's ticket (``publish``). So the host schedules and
    launches the next step meanwhile, and the device waits only if the fill outlasts the forward before it.

    One buffer serves every step: a fill starts only once the matchers have the previous step's tokens, which the
    host reads back after the device copied the buffer for them. The host must not block on the device while the
    device waits for a fill: the sampled tokens' ``result`` waits for the fill first (``SampledTokens.waits_for``,
    a ``HandedOff``), and ``open`` lets every wait go at shutdown. A wait that gave up (``MAX_POLLS``: a fill that
    never ended, or a thread elsewhere in the process blocking on the device while it holds the GIL that the fill
    needs to raise the flag) is an error at the read-back, never a token sampled under a stale mask. The flag is
    written after the fill's threads have joined; on x86 the device cannot see it before the rows (stores keep
    their order), which is the ordering this relies on. On the CPU the sampler runs on the host, so there the
    step's launch waits for its fill (``to_device``)."""

    OPEN = 1 << 62  # the flag's value once nothing may wait any more

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.on_device = device.type == "cuda"
        words = (vocab_size + 31) // 32
        self.host = torch.empty((max_rows, words), dtype=torch.int32, pin_memory=self.on_device)
        self.rows = torch.empty((max_rows, words), dtype=torch.int32, device=device) if self.on_device else None
        self.flag = torch.zeros(1, dtype=torch.int64, pin_memory=self.on_device)
        self._flag = self.flag.numpy()  # written without torch: one aligned 8-byte store
        self.gave_up = torch.zeros(1, dtype=torch.int64, pin_memory=self.on_device)  # by the device: wait_for_flag
        self.lock = threading.Lock()  # publish (the fill's thread) against open (the engine's)
        self.ticket = 0

    @classmethod
    def create(cls, max_rows: int, vocab_size: int, device: torch.device) -> BitmaskHandoff | None:
        """A handoff whose device wait has been checked once, or None where the device cannot wait for the host (no
        Triton: then the engine fills before it launches the sampler)."""
        try:
            handoff = cls(max_rows, vocab_size, device)
            if handoff.on_device:
                ticket = handoff.reserve()
                handoff.publish(ticket)
                handoff.to_device(ticket, 1, None)
                torch.cuda.current_stream(device).synchronize()
                handoff.check(ticket)
            return handoff
        except Exception as e:  # ImportError (no Triton), or a Triton that cannot read pinned host memory
            logger.warning("structured outputs: the sampler waits for each bitmask's fill on the host (%s)", e)
            return None

    def reserve(self) -> int:
        """The next step's ticket (before its fill starts)."""
        self.ticket += 1
        return self.ticket

    def publish(self, ticket: int) -> None:
        """The fill of ``ticket``'s buffer has ended: the device may copy it (from the fill's thread)."""
        with self.lock:
            if ticket > self._flag[0]:
                self._flag[0] = ticket

    def open(self) -> None:
        """No wait on the device holds from now on (at shutdown); the waits already launched are let through before
        the flag's memory can go back to torch's pinned cache and be reused."""
        with self.lock:
            self._flag[0] = self.OPEN
        if self.on_device:
            try:
                torch.cuda.current_stream(self.rows.device).synchronize()
            except Exception:  # a device that failed: nothing of ours waits on it any more
                pass

    def check(self, ticket: int) -> None:
        """Raises if the device's wait for ``ticket``'s fill gave up (after the step's tokens were read back)."""
        if self.on_device and self.gave_up[0] >= ticket:
            raise RuntimeError("the device stopped waiting for a structured-output bitmask (its fill did not end "
                               "within triton_sampler.MAX_POLLS polls of the flag): the step's tokens were sampled "
                               "without it")

    def to_device(self, ticket: int, num_rows: int, fill: Future | None) -> torch.Tensor:
        """The bitmask's first ``num_rows`` rows for the sampler: on CUDA, the device copy of the buffer, made once
        the flag reaches ``ticket`` (the host does not wait); on the CPU, ``fill``'s bitmask, once it is done."""
        if not self.on_device:
            return fill.result()
        from nanovllm.kernels import triton_sampler
        triton_sampler.wait_for_flag(self.flag, self.gave_up, ticket)
        return self.rows[:num_rows].copy_(self.host[:num_rows], non_blocking=True)


class HandedOff:
    """A step's bitmask fill that the device waits for (``BitmaskHandoff``), as its sampled tokens see it:
    ``wait`` before the host waits on the device (raising the fill's error), ``check`` after."""

    def __init__(self, fill: Future, handoff: BitmaskHandoff, ticket: int):
        self.fill, self.handoff, self.ticket = fill, handoff, ticket

    def wait(self) -> None:
        self.fill.result()

    def check(self) -> None:
        self.handoff.check(self.ticket)


@functools.cache
def _background() -> ThreadPoolExecutor:
    """The thread that fills a bitmask while the engine builds its next step (one for the process)."""
    return ThreadPoolExecutor(1, thread_name_prefix="nanovllm-fill")


def accept_tokens(grammars: list[Grammar], token_ids: list[int],
                  method: str | None = None) -> list[RuntimeError | None]:
    """Advances each grammar by its token, by ``method`` (ACCEPT_METHOD by default): "loop", one call a matcher,
    or "batch", one call into xgrammar for all (BatchGrammarMatcher.batch_accept_token); per grammar, the error
    of a refused token (``Grammar.refused``) or None."""
    method = ACCEPT_METHOD if method is None else method
    if method not in ACCEPT_METHODS:
        raise ValueError(f"accept method {method!r} is not one of {ACCEPT_METHODS}")
    if not grammars:
        return []
    if method == "batch":
        accepted = import_xgrammar().BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], token_ids)
    else:
        accepted = [g.matcher.accept_token(t) for g, t in zip(grammars, token_ids)]
    errors = []
    for grammar, token_id, ok in zip(grammars, token_ids, accepted):
        errors.append(None if ok else grammar.refused(token_id))
        grammar.num_accepted += ok
    return errors


@functools.cache
def _fill_pool() -> ThreadPoolExecutor:
    """One pool for every engine of the process (its idle threads cost nothing; none is left per engine)."""
    return ThreadPoolExecutor(max(1, FILL_THREADS - 1), thread_name_prefix="nanovllm-bitmask")


def fill_rows(rows: list[tuple[int, object]], bitmask: torch.Tensor, threads: int | None = None,
              method: str | None = None) -> None:
    """Each (row, matcher)'s allowed tokens into its row of ``bitmask``, split over up to ``threads`` threads
    (FILL_THREADS by default) by ``method`` (FILL_METHOD by default); a matcher's error is raised here."""
    threads = FILL_THREADS if threads is None else threads
    method = FILL_METHOD if method is None else method
    if method not in FILL_METHODS:
        raise ValueError(f"fill method {method!r} is not one of {FILL_METHODS}")
    n = min(threads, len(rows) // FILL_MIN_ROWS)
    if n <= 1:
        for row, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, row)
    elif method == "batch":
        _batch_matcher(n).batch_fill_next_token_bitmask([m for _, m in rows], bitmask, [row for row, _ in rows])
    else:
        _fill_in_pool(rows, bitmask, n)


@functools.cache
def _batch_matcher(threads: int):
    return import_xgrammar().BatchGrammarMatcher(threads)


def _fill_in_pool(rows: list[tuple[int, object]], bitmask: torch.Tensor, n: int) -> None:
    """Rows dealt in turn to ``n`` threads (so that rows of similar states spread), the caller's among them."""
    chunks = [rows[i::n] for i in range(n)]
    futures = [_fill_pool().submit(fill_rows, chunk, bitmask, 1) for chunk in chunks[1:]]
    try:
        fill_rows(chunks[0], bitmask, 1)
    finally:
        wait(futures)  # no thread writes into the bitmask once this returns
    for future in futures:
        future.result()
