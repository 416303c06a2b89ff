"""Paged KV-cache blocks, reference counts, the prefix cache. Invariant: a full block is hashed once
its ids are known and the forward writing it is launched: a later hit never reads unwritten K/V."""
from __future__ import annotations

from collections import deque

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    def __init__(self, block_id: int):
        self.block_id, self.ref_count, self.hash, self.token_ids = block_id, 0, -1, []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.num_cache_hits = 0  # over the engine's life

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids, dtype=np.int64).tobytes())
        return h.intdigest()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; refused (False) while a sequence holds blocks."""
        if self.used_block_ids:
            return False
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.hash, block.token_ids = -1, []
        return True

    def _allocate_block(self) -> int:
        block = self.blocks[self.free_block_ids.popleft()]
        assert block.ref_count == 0
        if self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.ref_count = -1, [], 1
        self.used_block_ids.add(block.block_id)
        return block.block_id

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks of ``seq``'s leading full blocks, never the last token's (needs logits)."""
        hits, h = [], -1
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = self.compute_hash(token_ids := seq.block(i), h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, use_prefix_cache: bool = True) -> bool:
        """Blocks for all of ``seq``'s tokens (cached prefix ones reused) if enough are free."""
        assert not seq.block_table
        hits = self.cached_prefix(seq) if use_prefix_cache else []
        if self.num_free_blocks < seq.num_blocks - sum(self.blocks[i].ref_count > 0 for i in hits):
            return False
        for block_id in hits:
            if self.blocks[block_id].ref_count == 0:  # a freed block whose K/V is still intact
                self.free_block_ids.remove(block_id)
                self.used_block_ids.add(block_id)
            self.blocks[block_id].ref_count += 1
        seq.num_cached_tokens += len(hits) * self.block_size
        seq.num_hashed_blocks += len(hits)
        self.num_cache_hits += len(hits)
        seq.block_table.extend(hits)
        seq.block_table.extend(self._allocate_block() for _ in range(seq.num_blocks - len(hits)))
        return True

    def deallocate(self, seq: Sequence):
        for block_id in reversed(seq.block_table):
            self.blocks[block_id].ref_count -= 1
            if self.blocks[block_id].ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.num_cached_tokens = seq.num_hashed_blocks = 0
        seq.block_table.clear()

    def allocate_slot(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Slots for the next forward's token and ``lookahead`` more; False if no block is free."""
        while len(seq.block_table) * self.block_size < seq.num_tokens + lookahead:
            if not self.num_free_blocks:
                return False
            seq.block_table.append(self._allocate_block())
        return True

    def hash_blocks(self, seq: Sequence):
        """Registers the full blocks that are computed (or being computed) with no pending token."""
        first = seq.num_hashed_blocks
        last = min(seq.num_cached_tokens, len(seq.token_ids)) // self.block_size
        if last <= first:
            return
        h = self.blocks[seq.block_table[first - 1]].hash if first > 0 else -1
        seq.num_hashed_blocks = last
        for i in range(first, last):
            block, token_ids = self.blocks[seq.block_table[i]], seq.block(i)
            h = self.compute_hash(token_ids, h)
            block.hash, block.token_ids = h, token_ids
            self.hash_to_block_id[h] = block.block_id
