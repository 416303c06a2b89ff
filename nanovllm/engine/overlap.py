"""Async scheduling (CUDA's default): step N+1 is scheduled, built and launched before step N is
read back, so that the host's work overlaps the device's."""
from __future__ import annotations

from nanovllm.engine.core import EngineCore


class OverlapEngineCore(EngineCore):
    def overlap_step(self) -> int:
        batch = self._schedule()
        if batch.seqs and self.inflight and any(h.needs_known_tokens(batch) for h in self.hooks):
            self.read_back()  # penalties read every known token
            batch.drop([seq for seq in batch.seqs if seq.is_finished])
        output = self.launch(batch) if batch.seqs else None
        self.read_back()  # the step launched before this one
        self.inflight = (batch, output) if output is not None else None
        return batch.num_tokens

    one_step = overlap_step
