"""Metrics, a feature (vLLM's ``LLM(disable_log_stats=False)``): the metric types of
``LLM.get_metrics()`` (``nanovllm.v1.metrics.reader``'s), and ``EngineStats``, which counts them."""
from __future__ import annotations

import collections
from dataclasses import dataclass

from nanovllm.engine.sampling import LogitsHook
from nanovllm.engine.sequence import Sequence
from nanovllm.plugins import Feature


@dataclass
class Metric:
    name: str
    labels: dict[str, str]  # model_name, engine; finished_reason for request_success


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


class EngineStats(LogitsHook):
    """``get_metrics()``'s counters, on a logits hook's add and forget (the logits are left alone).
    A sequence is vLLM's request (``n`` completions count ``n``), added up when it ends; a live one
    counts in every snapshot."""

    def __init__(self):
        self.live: dict[int, Sequence] = {}
        self.ended = collections.Counter(dict.fromkeys(
            ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits"), 0))
        self.finished = dict.fromkeys(("stop", "length", "abort", "error"), 0)

    def add(self, seqs: list[Sequence], params) -> None:
        self.live.update((seq.seq_id, seq) for seq in seqs)

    def forget(self, seq: Sequence) -> None:
        if self.live.pop(seq.seq_id, None) is not None:
            self.ended.update(_counts(seq))
            self.finished[seq.finish_reason] += 1

    def snapshot(self, scheduler, model: str) -> list[Metric]:
        labels = {"model_name": model, "engine": "0"}
        totals = collections.Counter(self.ended)
        for seq in self.live.values():
            totals.update(_counts(seq))
        blocks = scheduler.block_manager
        gauges = {"num_requests_running": len(scheduler.running),
                  "num_requests_waiting": len(scheduler.waiting)
                                          + sum(map(len, scheduler.held.values())),
                  "kv_cache_usage_perc": len(blocks.used_block_ids) / len(blocks.blocks)}
        counters = {"num_preemptions": scheduler.num_preemptions, **totals}
        metrics = [Gauge(f"vllm:{name}", dict(labels), value) for name, value in gauges.items()]
        metrics += [Counter(f"vllm:{name}", dict(labels), value)
                    for name, value in counters.items()]
        return metrics + [Counter("vllm:request_success", {**labels, "finished_reason": reason},
                                  count) for reason, count in self.finished.items()]


def _counts(seq: Sequence) -> dict[str, int]:
    """A sequence's share: its prompt once prefilled, its known tokens, its prefix-cache lookup (in
    tokens)."""
    generated = len(seq.token_ids) - seq.num_prompt_tokens
    looked_up = seq.num_prefix_cached_tokens is not None
    return {"prompt_tokens": seq.num_prompt_tokens if generated else 0,
            "generation_tokens": generated,
            "prefix_cache_queries": seq.num_prompt_tokens if looked_up else 0,
            "prefix_cache_hits": seq.num_prefix_cached_tokens or 0}


class Metrics(Feature):
    def setup_engine(self, engine) -> None:
        self.stats = EngineStats()
        engine.core.hooks.append(self.stats)
