"""Structured outputs on rank 0 (xgrammar): compiled constraints, a grammar matcher per constrained
sequence, and each step's token bitmask (an int32 row of ``ceil(vocab / 32)`` words a sequence, bit
t set where token t is allowed). A matcher's stop tokens are the EOS ids, so EOS is allowed where
the output is complete."""
from __future__ import annotations

import functools
import json
import json as _json
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from nanovllm.engine.llm_engine import require_tokenizer
from nanovllm.engine.sampling import LogitsHook, SamplingInputs
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.features.bitmask_handoff import BitmaskHandoff, PendingFill, background
from nanovllm.features.structured_checks import TOO_DEEP, check_regex, checked_schema
from nanovllm.kernels import ops_for
from nanovllm.plugins import Feature
from nanovllm.sampling_params import check_bool

# xgrammar's C++ errors begin with a time and a source location: "[19:07:16] /project/cpp/x.cc:94: "
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# a step's rows are filled by xgrammar's batch matcher on up to FILL_THREADS threads, FILL_MIN_ROWS
# rows each
FILL_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1)
FILL_MIN_ROWS = 4
# compiled grammars kept, least recently used dropped first
CACHE_SIZE = 256
CACHE_BYTES = 512 * 2 ** 20


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured_outputs needs xgrammar, nanovllm's optional extra: pip "
                         "install -e '.[structured]'") from e
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose strings are exactly ``choices`` (JSON string escapes are EBNF's
    too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(eq=False)
class Matcher:
    """A sequence's grammar matcher: it has accepted exactly the sequence's known completion
    tokens."""

    matcher: object
    num_accepted: int = 0


class StructuredOutputManager(LogitsHook):
    """Rank 0's structured outputs: the compiled grammars, a matcher per constrained sequence, and
    each step's bitmask, filled while the device runs the forward (``prepare``)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        """``vocab_size``: the logits' width; ids past the tokenizer's are never allowed."""
        self.tokenizer, self.vocab_size, self.eos_token_ids = (
            tokenizer, vocab_size, list(eos_token_ids))
        # (what, spec, any_whitespace) -> CompiledGrammar
        self.cache: OrderedDict[tuple, object] = OrderedDict()
        self.cache_bytes = 0
        self.lock = threading.Lock()  # admissions compile from the callers' threads
        self.matchers: dict[int, Matcher] = {}  # by seq_id
        self.fill_seconds = 0.0  # in fill_rows, since the engine started
        # made on the first handoff (False: cannot be)
        self.handoff: BitmaskHandoff | None | bool = None
        self.last_fill: PendingFill | None = None
        self.bind(torch.device("cpu"), 0, False)

    def bind(self, device: torch.device, max_rows: int, can_hand_off: bool) -> None:
        """Where the bitmasks go; ``can_hand_off``: one rank with async scheduling
        (``BitmaskHandoff``)."""
        self.device, self.max_rows, self.can_hand_off = device, max_rows, can_hand_off

    @functools.cached_property
    def compiler(self):
        xgr = import_xgrammar()
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer, but skip_tokenizer_init=True")
        if not self.eos_token_ids:
            raise ValueError("structured_outputs need an EOS token, and the model has none")
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        # our cache is keyed by the constraint
        return xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams):
        """The constraint's compiled grammar (cached); a ``ValueError`` naming the field if it does
        not compile or matches nothing."""
        kind, schema = params.kind, params.json
        spec = {"json": lambda: json.dumps(json.loads(schema) if isinstance(schema, str)
                                           else schema),
                "json_object": lambda: '{"type": "object"}', "regex": lambda: params.regex,
                "grammar": lambda: params.grammar,
                "choice": lambda: choice_grammar(params.choice)}[kind]()
        if kind == "grammar" and "::=" not in spec:  # vLLM would take it for a Lark grammar
            raise ValueError("structured_outputs.grammar must be xgrammar's EBNF (`root ::= ...`); "
                             f"Lark grammars are not supported, got {spec!r:.80}")
        # keyed by what xgrammar compiles: a choice is a grammar, json_object a schema
        key = ({"json_object": "json", "choice": "grammar"}.get(kind, kind), spec,
               not params.disable_any_whitespace)
        with self.lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                self.cache.move_to_end(key)
                return compiled
            xgr, compiler = import_xgrammar(), self.compiler
            if key[0] == "json":  # checked at verify; rewritten here, once per cached grammar
                spec = json.dumps(checked_schema(json.loads(spec)))
            try:
                if key[0] == "json":
                    compiled = compiler.compile_json_schema(spec, any_whitespace=key[2])
                elif key[0] == "regex":
                    compiled = compiler.compile_regex(spec)
                else:
                    compiled = compiler.compile_grammar(spec)
            except Exception as e:  # xgrammar raises RuntimeError (and its own errors) from C++
                reason = (_XGR_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e).strip()
                          else type(e).__name__)
                raise ValueError(f"structured_outputs.{kind} does not compile: {reason}") from None
            first = torch.zeros(xgr.get_bitmask_shape(1, self.vocab_size), dtype=torch.int32)
            (xgr.GrammarMatcher(compiled, override_stop_tokens=self.eos_token_ids)
             .fill_next_token_bitmask(first))
            if not first.any():  # no first token, not even EOS
                raise ValueError(f"structured_outputs.{kind} matches no string")
            self.cache[key] = compiled
            self.cache_bytes += getattr(compiled, "memory_size_bytes", 0)
            while len(self.cache) > 1 and (len(self.cache) > CACHE_SIZE
                                           or self.cache_bytes > CACHE_BYTES):
                self.cache_bytes -= getattr(self.cache.popitem(last=False)[1],
                                            "memory_size_bytes", 0)
            return compiled

    def add(self, seqs: list[Sequence], params) -> None:
        if params.structured_outputs is None:
            return
        compiled = self.compile(params.structured_outputs)
        for seq in seqs:
            self.matchers[seq.seq_id] = Matcher(
                import_xgrammar().GrammarMatcher(compiled, override_stop_tokens=self.eos_token_ids))

    def forget(self, seq: Sequence) -> None:
        self.matchers.pop(seq.seq_id, None)

    def accept(self, advanced: list[tuple[Sequence, int]]) -> dict[Sequence, Exception]:
        refused = {}
        for seq, token_id in advanced:
            matcher = self.matchers.get(seq.seq_id)
            if matcher is None or token_id < 0:  # < 0: no token (non-finite logits): ended
                continue
            if matcher.matcher.accept_token(token_id):
                matcher.num_accepted += 1
            else:  # sampled under this matcher's mask, it never should be
                refused[seq] = RuntimeError(f"the grammar refused token {token_id} after "
                                            f"{matcher.num_accepted} accepted tokens")
        return refused

    def prepare(self, batch: SchedulerOutput, sampling: SamplingInputs, read_back) -> None:
        """The step's bitmask needs every known token: with a constrained row's token in flight,
        that step is read back first, beside this forward; with a handoff the fill then runs in a
        thread."""
        rows = [row for row in batch.kept_rows if batch.seqs[row].seq_id in self.matchers]
        if not rows:
            return
        prev, pin = batch.step_input.prev_rows, self.device.type == "cuda"
        if read_back is None or prev is None or not any(prev[row] >= 0 for row in rows):
            if self.last_fill is not None:  # one fill at a time: they share xgrammar's threads
                self.last_fill, last = None, self.last_fill
                last.wait()
            self._mask(sampling, self.grammar_bitmask(batch.seqs, rows, pin))
            return
        handoff = self._bitmask_handoff(len(batch.seqs))
        if handoff is None:
            read_back()
            self._mask(sampling, self.grammar_bitmask(batch.seqs, rows, pin))
            return
        ticket, started = handoff.reserve(), []
        read_back(after_accept=lambda refused: started.append(self.grammar_bitmask_async(
            batch.seqs, rows, pin, refused, handoff.host, lambda: handoff.publish(ticket))))
        if started[0] is not None:
            self._mask(sampling, handoff.to_device(ticket, len(batch.seqs), started[0]))
            self.last_fill = PendingFill(started[0], handoff, ticket)
            sampling.host_work.append(self.last_fill)

    def _mask(self, sampling: SamplingInputs, bitmask: torch.Tensor | None) -> None:
        """The sampler's first mask: ``bitmask`` applied to the logits (on their device)."""
        if bitmask is None:
            return
        if bitmask.device != self.device:
            bitmask = bitmask.to(self.device, non_blocking=True)

        def mask(logits: torch.Tensor) -> torch.Tensor:
            kernels = ops_for(logits, "triton_sampler", None) if logits.stride(1) == 1 else None
            apply = kernels.apply_token_bitmask if kernels is not None else apply_token_bitmask
            return apply(logits, bitmask)
        sampling.batch.masks.append(mask)

    def _bitmask_handoff(self, num_rows: int) -> BitmaskHandoff | None:
        """The handoff for a step of ``num_rows`` sequences, or None where the sampler must wait for
        the fill."""
        if not self.can_hand_off:
            return None
        if self.handoff is None:
            self.handoff = (BitmaskHandoff.create(self.max_rows, self.vocab_size, self.device)
                            or False)
        return self.handoff if self.handoff and num_rows <= self.handoff.host.size(0) else None

    def shutdown(self) -> None:
        if self.handoff:
            self.handoff.open()

    def grammar_bitmask(self, seqs: list[Sequence], rows: list[int],
                        pin_memory: bool = False) -> torch.Tensor | None:
        """The step's bitmask on the host ([len(seqs), ceil(vocab / 32)] int32), or None if no row
        is constrained."""
        prepared = self._prepare_bitmask(seqs, rows, pin_memory)
        return None if prepared is None else self._fill(*prepared)

    def grammar_bitmask_async(self, seqs: list[Sequence], rows: list[int], pin_memory: bool = False,
                              skip=(), out: torch.Tensor | None = None, done=None) -> Future | None:
        """``grammar_bitmask`` filled into ``out`` on the fill thread (xgrammar lets go of the GIL),
        or None; rows in ``skip`` are left free, and ``done()`` is called once the fill has ended,
        failed or not."""
        prepared = self._prepare_bitmask(seqs, rows, pin_memory, skip, out)
        if prepared is None:
            return None
        try:
            return background().submit(self._fill, *prepared, done)
        except RuntimeError:  # the interpreter is exiting and takes no new work: fill here
            result = Future()
            result.set_result(self._fill(*prepared, done))
            return result

    def _prepare_bitmask(self, seqs: list[Sequence], rows: list[int], pin_memory: bool,
                         skip=(), out=None):
        """The bitmask with its free rows set, and the (row, matcher) pairs left to fill; None if
        there are none."""
        matchers = {row: self.matchers.get(seqs[row].seq_id) for row in rows}
        constrained = [row for row in rows if matchers[row] is not None
                       and not seqs[row].is_finished and seqs[row] not in skip
                       and not matchers[row].matcher.is_terminated()]
        if not constrained:
            return None
        shape = import_xgrammar().get_bitmask_shape(len(seqs), self.vocab_size)
        # not torch.full: its parallel fill of the whole buffer competes with xgrammar's threads
        bitmask = (torch.empty(shape, dtype=torch.int32, pin_memory=pin_memory) if out is None
                   else out[:shape[0]])
        for row in set(range(len(seqs))).difference(constrained):
            bitmask[row].fill_(-1)
        assert all(matchers[r].num_accepted == len(seqs[r].token_ids) - seqs[r].num_prompt_tokens
                   for r in constrained)
        return bitmask, [(row, matchers[row].matcher) for row in constrained]

    def _fill(self, bitmask: torch.Tensor, rows: list[tuple[int, object]],
              done=None) -> torch.Tensor:
        start = time.perf_counter()
        try:
            fill_rows(rows, bitmask)
        finally:
            self.fill_seconds += time.perf_counter() - start
            if done is not None:
                done()
        return bitmask


def fill_rows(rows: list[tuple[int, object]], bitmask: torch.Tensor,
              threads: int | None = None) -> None:
    """Each (row, matcher)'s allowed tokens into its row of ``bitmask``, on xgrammar's batch
    matcher's threads."""
    n = min(FILL_THREADS if threads is None else threads, len(rows) // FILL_MIN_ROWS)
    if n <= 1:
        for row, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, row)
    else:
        _batch_matcher(n).batch_fill_next_token_bitmask([m for _, m in rows], bitmask,
                                                        [row for row, _ in rows])


@functools.cache
def _batch_matcher(threads: int):
    return import_xgrammar().BatchGrammarMatcher(threads)


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
BITMASK_CHUNK_ROWS = 16  # rows unpacked at a time: ~9 bytes a logit of temporaries


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets disallowed tokens' logits to -inf in place: token t of row b is allowed when bit t % 32
    of ``bitmask[b, t // 32]`` is set (xgrammar's layout). Chunked: the KV sizing cannot measure
    the temporaries."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    for start in range(0, logits.size(0), BITMASK_CHUNK_ROWS):
        rows = slice(start, start + BITMASK_CHUNK_ROWS)
        allowed = ((bitmask[rows, :, None] >> shifts) & 1).flatten(1)[:, :logits.size(1)]
        logits[rows].masked_fill_(allowed == 0, float("-inf"))
    return logits


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint, compiled by xgrammar: exactly one of ``json`` (a schema,
    dict or string), ``regex``, ``choice``, ``grammar`` (EBNF) or ``json_object=True``."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # xgrammar's behaviour already
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def verify(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(CONSTRAINTS)}; "
                             f"got {', '.join(given) or 'none'}")
        for name in ("structural_tag", "whitespace_pattern"):
            if (value := getattr(self, name)) is not None:
                raise ValueError(f"structured_outputs.{name} is not supported, got {value!r:.60}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            check_bool(f"structured_outputs.{name}", getattr(self, name))
        if self.json is not None:
            try:
                self._check_json()
            except RecursionError:
                raise ValueError(TOO_DEEP) from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty string, "
                                f"got {value!r:.80}")
        if self.regex is not None:
            check_regex(self.regex)
        choice = self.choice
        if choice is not None and not (isinstance(choice, (list, tuple)) and choice
                                       and all(isinstance(c, str) and c for c in choice)):
            raise TypeError("structured_outputs.choice must be a non-empty list of non-empty "
                            f"strings, got {choice!r:.80}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be True when given, "
                             f"got {self.json_object!r}")

    __post_init__ = verify

    def _check_json(self) -> None:
        if not isinstance(self.json, (str, dict)):
            raise TypeError("structured_outputs.json must be a JSON schema dict or string, "
                            f"got {self.json!r:.80}")
        try:
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON ({e}): "
                             f"{self.json!r:.80}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema object, "
                             f"got {self.json!r:.80}")
        try:
            _json.dumps(schema)  # the compiler is given its JSON text
        except (TypeError, ValueError) as e:
            raise TypeError(f"structured_outputs.json must be JSON-serializable ({e}): "
                            f"{self.json!r:.80}") from None
        checked_schema(schema)  # a ValueError naming what xgrammar would ignore

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)




class StructuredOutputs(Feature):
    """The feature, installed on rank 0 by a request's ``structured_outputs``."""

    @classmethod
    def verify_params(cls, params) -> None:
        constraint = params.structured_outputs
        if not isinstance(constraint, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams, "
                            f"got {constraint!r:.80}")
        constraint.verify()
        # the grammar decides where the output ends (EOS is allowed exactly where it is complete)
        if params.ignore_eos:
            raise ValueError("ignore_eos=True cannot be honoured with structured_outputs")
        if params.min_tokens:
            raise ValueError(f"min_tokens={params.min_tokens} cannot be honoured with "
                             "structured_outputs")

    def setup_engine(self, engine) -> None:
        config, runner = engine.config, engine.model_runner
        self.manager = StructuredOutputManager(engine.tokenizer, config.hf_config.vocab_size,
                                               config.eos_token_ids)
        self.manager.bind(runner.device, config.max_num_seqs,
                          engine.workers is None and bool(config.async_scheduling))
        engine.core.hooks.append(self.manager)

    def check_request(self, params, engine) -> None:
        if params.structured_outputs is not None:
            require_tokenizer(engine.tokenizer, "structured outputs")
            self.manager.compile(params.structured_outputs)  # a ValueError if it does not compile
