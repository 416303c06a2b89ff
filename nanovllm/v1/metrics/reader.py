"""vLLM's ``vllm.v1.metrics.reader``: the metric types that ``LLM.get_metrics()`` returns, under vLLM's names,
and ``EngineStats``, which counts them as the core admits and ends sequences."""
from __future__ import annotations

from dataclasses import dataclass

from nanovllm.engine.sampling import LogitsProcessor
from nanovllm.engine.sequence import Sequence

FINISHED_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Metric:
    """A metric's name and labels (``model_name``, ``engine``; ``finished_reason`` for request_success)."""

    name: str
    labels: dict[str, str]


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


class EngineStats(LogitsProcessor):
    """The counters behind ``get_metrics()``, on the core's hooks (it leaves the logits alone). A sequence is
    vLLM's request (``n`` completions count ``n``): it is added up when it ends, a live one in every snapshot."""

    def __init__(self):
        self.live: dict[int, Sequence] = {}
        self.ended = dict.fromkeys(("prompt_tokens", "generation_tokens", "prefix_cache_queries",
                                    "prefix_cache_hits"), 0)
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)

    def add(self, seqs: list[Sequence], params) -> None:
        self.live.update((seq.seq_id, seq) for seq in seqs)

    def forget(self, seq: Sequence) -> None:
        if self.live.pop(seq.seq_id, None) is not None:
            for name, value in _counts(seq).items():
                self.ended[name] += value
            self.finished[seq.finish_reason] += 1

    def snapshot(self, scheduler, model: str) -> list[Metric]:
        """vLLM's gauges and counters now, over the engine's life."""
        labels = {"model_name": model, "engine": "0"}
        totals = dict(self.ended)
        for seq in self.live.values():
            for name, value in _counts(seq).items():
                totals[name] += value
        blocks = scheduler.block_manager
        waiting = len(scheduler.waiting) + sum(map(len, scheduler.held.values()))
        metrics: list[Metric] = [
            Gauge("vllm:num_requests_running", dict(labels), len(scheduler.running)),
            Gauge("vllm:num_requests_waiting", dict(labels), waiting),
            Gauge("vllm:kv_cache_usage_perc", dict(labels), len(blocks.used_block_ids) / len(blocks.blocks)),
            Counter("vllm:num_preemptions", dict(labels), scheduler.num_preemptions)]
        metrics += [Counter(f"vllm:{name}", dict(labels), value) for name, value in totals.items()]
        return metrics + [Counter("vllm:request_success", {**labels, "finished_reason": reason}, count)
                          for reason, count in self.finished.items()]


def _counts(seq: Sequence) -> dict[str, int]:
    """A sequence's share: its prompt once prefilled, its known tokens, its prefix-cache lookup (in tokens)."""
    generated = len(seq.token_ids) - seq.num_prompt_tokens
    looked_up = seq.num_prefix_cached_tokens is not None
    return {"prompt_tokens": seq.num_prompt_tokens if generated else 0, "generation_tokens": generated,
            "prefix_cache_queries": seq.num_prompt_tokens if looked_up else 0,
            "prefix_cache_hits": seq.num_prefix_cached_tokens or 0}
