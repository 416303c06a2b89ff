"""What only CUDA runs: decode under CUDA graphs, one per batch-size bucket, captured largest first
into one memory pool (a step replays the smallest that covers its batch, its padding rows at slot -1
and context length 0); the warmup that sizes the KV cache; waits on device events."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.engine.batch import prepare_prefill
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels.cascade_reference import MAX_GROUPS, SharedPrefixes
from nanovllm.utils.context import Context, set_context


def bucket_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 below ``max_bs``, and ``max_bs``."""
    return sorted({bs for bs in [1, 2, 4, 8, *range(16, max_bs + 16, 16)] if bs < max_bs}
                  | {max_bs})


class DecodeGraphs:
    """Captured on construction, on the default device and dtype; a bucket's cascade graph (decode
    attention with shared prefixes, at most MAX_GROUPS groups) on its first use, under ``build``
    (the runner's device and dtype)."""

    @torch.inference_mode()
    def __init__(self, model: nn.Module, max_bs: int, max_num_blocks: int, hidden_size: int,
                 build: Callable = contextlib.nullcontext):
        self.model, self.build, self.batch_sizes = model, build, bucket_sizes(max_bs)
        ints = dict(input_ids=torch.int64, positions=torch.int64, slot_mapping=torch.int32,
                    context_lens=torch.int32, seq_shared_len=torch.int32)
        b = self.buffers = {name: torch.zeros(max_bs, dtype=dtype) for name, dtype in ints.items()}
        b["block_tables"] = torch.zeros(max_bs, max_num_blocks, dtype=torch.int32)
        b["groups"] = torch.zeros(3, MAX_GROUPS, dtype=torch.int32)  # first row, rows, shared
        b["outputs"] = torch.zeros(max_bs, hidden_size)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None
        for bs in reversed(self.batch_sizes):
            self.capture(bs, cascade=False)

    def capture(self, bs: int, cascade: bool):
        b, graph = self.buffers, torch.cuda.CUDAGraph()
        prefixes = (SharedPrefixes(*b["groups"], b["seq_shared_len"][:bs], bs) if cascade
                    else None)
        with set_context(False, slot_mapping=b["slot_mapping"][:bs],
                         context_lens=b["context_lens"][:bs],
                         block_tables=b["block_tables"][:bs], prefixes=prefixes):
            b["outputs"][:bs] = self.model(b["input_ids"][:bs], b["positions"][:bs])  # warmup
            # thread_local: another engine may run kernels in another thread while this one
            # captures
            with torch.cuda.graph(graph, self.pool, capture_error_mode="thread_local"):
                b["outputs"][:bs] = self.model(b["input_ids"][:bs], b["positions"][:bs])
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs, cascade] = graph
        torch.cuda.synchronize()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               context: Context) -> torch.Tensor:
        """The decoder's hidden states [bs, hidden] for this decode step (the buffers are filled
        before a first capture, whose warmup then writes this step's K/V as the replay will)."""
        bs = input_ids.size(0)
        key = next(x for x in self.batch_sizes if x >= bs), context.prefixes is not None
        b = self.buffers
        b["input_ids"][:bs] = input_ids
        b["positions"][:bs] = positions
        b["slot_mapping"].fill_(-1)
        b["slot_mapping"][:bs] = context.slot_mapping
        b["context_lens"].zero_()
        b["context_lens"][:bs] = context.context_lens
        b["block_tables"][:bs, :context.block_tables.size(1)] = context.block_tables
        if key[1]:
            groups = context.prefixes
            b["groups"].zero_()  # groups past this step's have no rows
            for i in range(3):
                b["groups"][i, :groups[i].numel()] = groups[i]
            b["seq_shared_len"].zero_()
            b["seq_shared_len"][:bs] = groups.seq_shared_len
        if key not in self.graphs:
            with self.build(), torch.inference_mode():
                self.capture(*key)
        self.graphs[key].replay()
        return b["outputs"][:bs]


def wait_for_event(event, alive: Callable[[], bool] | None = None, poll_s: float = 2e-4,
                   check_every_s: float = 0.05) -> None:
    """Returns once ``event`` has completed. With ``alive`` it polls, raising once ``alive()`` is
    False: a forward whose collectives wait for a dead NCCL rank never ends."""
    if alive is None:
        return event.synchronize()
    next_check = time.monotonic() + check_every_s
    while not event.query():
        if time.monotonic() >= next_check:
            if not alive():
                raise RuntimeError("a tensor-parallel worker died during a forward")
            next_check = time.monotonic() + check_every_s
        time.sleep(poll_s)


def warmup_model(runner):
    """A prefill at the largest batch, so that the KV sizing sees the peak activations; its slots
    of -1 store nothing into a throwaway one-block cache."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    max_tokens = runner.config.max_num_batched_tokens
    seq_len = min(max_tokens, runner.config.max_model_len)
    num_seqs = max(1, min(max_tokens // seq_len, runner.config.max_num_seqs))
    seqs = [Sequence([0] * seq_len, block_size=runner.block_size) for _ in range(num_seqs)]
    for seq in seqs:
        seq.num_scheduled_tokens = seq_len
    dummy = torch.zeros(1, runner.block_size, runner.num_kv_heads, runner.head_dim,
                        dtype=runner.kv_dtype)
    for layer in runner.attention_layers:
        layer.k_cache = layer.v_cache = dummy
    sampling = runner.prepare_sample(SchedulerOutput(seqs, True)) if runner.rank == 0 else None
    runner.run(prepare_prefill(seqs, runner.block_size), sampling)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
