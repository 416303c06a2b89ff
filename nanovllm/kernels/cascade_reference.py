"""Cascade decode attention in PyTorch (the oracle of ``triton_attention.decode_attention`` with
``prefixes``): sequences of a decode batch that hold the same leading KV blocks attend over those
shared blocks once, all their queries together, and over the rest of their context each alone; the
two parts merge by their log-sum-exp. The result is ``reference.decode_attention``'s, up to
rounding.

Groups (``SharedPrefixes``) come from the block tables as they are: a run of consecutive rows whose
tables start with the same block ids (a prefix-cache hit, the ``n`` completions of a prompt, an RL
group). ``cascade_groups`` is the rule by which a decode step takes the cascade (``PrefixGroups``:
the groups on the host, as the step's input carries them to every rank).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from nanovllm.kernels.reference import gather_blocks


class SharedPrefixes(NamedTuple):
    """Groups of a decode batch: group g is rows [first_row[g], first_row[g] + num_rows[g]), which
    share their first shared_len[g] tokens (whole blocks); ``seq_shared_len`` [B]: each row's shared
    tokens (0 outside every group). int32 tensors on the batch's device; ``max_rows``: the most rows
    a group has (the kernels' grid). A group has 2 rows or more (0: an empty slot)."""
    first_row: torch.Tensor
    num_rows: torch.Tensor
    shared_len: torch.Tensor
    seq_shared_len: torch.Tensor
    max_rows: int


def shared_prefix_groups(block_tables, context_lens, block_size: int, min_rows: int = 2,
                         min_blocks: int = 1) -> list[tuple[int, int, int]]:
    """(first row, rows, shared blocks) of each run of at least ``min_rows`` consecutive rows whose
    tables share at least ``min_blocks`` leading blocks; the shared blocks are those every row of
    the run holds, each row's last cached token outside them (its block may still be written; a
    shared block is full). Rows of one run share the longest prefix common to all of them; a row
    that would shorten its run's prefix below ``min_blocks`` starts a new run. ``block_tables``:
    [B, W] (-1 padded) or lists. Vectorized (69 µs for 256 rows of 40 blocks on a 2-core CPU,
    2026-12-05): a row shares with its run's first row what it shares with the row before it, so
    each run's prefix is the least of its adjacent pairs' common prefixes."""
    lens = np.asarray(context_lens, dtype=np.int64)
    if len(lens) < 2:
        return []
    if isinstance(block_tables, np.ndarray):
        tables = block_tables
    else:
        tables = np.full((len(lens), max(len(t) for t in block_tables)), -1, dtype=np.int64)
        for row, t in zip(tables, block_tables):
            row[:len(t)] = t
    limit = (lens - 1) // block_size  # full blocks before each row's last token's
    differ = np.concatenate([tables[1:] != tables[:-1],
                             np.ones((len(lens) - 1, 1), dtype=bool)], axis=1)
    pair = np.minimum(differ.argmax(axis=1), np.minimum(limit[:-1], limit[1:]))
    joined = pair >= min_blocks  # row k + 1 continues row k's run
    groups = []
    starts = np.flatnonzero(np.concatenate([[True], ~joined]))
    ends = np.append(starts[1:], len(lens))
    for first, end in zip(starts.tolist(), ends.tolist()):
        if end - first >= max(min_rows, 2):
            groups.append((first, end - first, int(pair[first:end - 1].min())))
    return groups


# When the cascade pays (``cascade_groups``): groups of at least MIN_ROWS rows sharing at least
# MIN_SHARED_TOKENS tokens, at most MAX_GROUPS a step (a CUDA graph's capacity; those that save the
# most reads kept), and only when they spare the step at least MIN_SAVED_TOKENS token reads a layer
# (a group of r rows sharing s tokens spares (r - 1) * s). Measured (one layer, batches 4-512,
# tools/bench_cascade.py, H100, 2026-12-05; docs/PERFORMANCE.md): the groups it takes gain 1.3-8.6x
# sharing 2,048 tokens or more, 0.9-2.1x sharing 1,024; groups of 2 gain 1.14x at most, and shared
# prefixes of 64-256 tokens 1.05x at most, at every batch measured.
MIN_ROWS, MIN_SHARED_TOKENS, MAX_GROUPS, MIN_SAVED_TOKENS = 8, 1024, 64, 16384


class PrefixGroups(NamedTuple):
    """``SharedPrefixes`` on the host: groups [3, G] int32 (first row, rows, shared tokens),
    seq_shared_len [B] int32, max_rows."""
    groups: np.ndarray
    seq_shared_len: np.ndarray
    max_rows: int

    def on_device(self, to_device) -> SharedPrefixes:  # to_device: host array -> device tensor
        return SharedPrefixes(*to_device(self.groups), to_device(self.seq_shared_len),
                              self.max_rows)


def cascade_groups(block_tables: np.ndarray, context_lens: np.ndarray,
                   block_size: int) -> PrefixGroups | None:
    """The groups of a decode batch that the cascade reads once, by the rule above, or None."""
    groups = shared_prefix_groups(block_tables, context_lens, block_size, MIN_ROWS,
                                  -(-MIN_SHARED_TOKENS // block_size))
    groups = sorted(sorted(groups, key=lambda g: -(g[1] - 1) * g[2])[:MAX_GROUPS])
    if sum((rows - 1) * blocks for _, rows, blocks in groups) * block_size < MIN_SAVED_TOKENS:
        return None
    return prefix_groups(groups, len(context_lens), block_size)


def prefix_groups(groups: list[tuple[int, int, int]], batch: int, block_size: int,
                  capacity: int | None = None) -> PrefixGroups:
    """``shared_prefix_groups``'s list as host arrays. ``capacity``: that many groups, the missing
    ones empty (no rows), and ``max_rows`` the batch, so that the kernels' grids depend on the batch
    size alone (a CUDA graph replays them for other groups)."""
    seq_shared = np.zeros(batch, dtype=np.int32)
    for first, rows, blocks in groups:
        seq_shared[first:first + rows] = blocks * block_size
    max_rows = max((rows for _, rows, _ in groups), default=0)
    if capacity is not None:
        if len(groups) > capacity:
            raise ValueError(f"{len(groups)} groups, capacity={capacity}")
        groups, max_rows = groups + [(0, 0, 0)] * (capacity - len(groups)), batch
    table = np.array(groups, dtype=np.int32).reshape(-1, 3).T.copy()
    table[2] *= block_size
    return PrefixGroups(table, seq_shared, max_rows)


def as_shared_prefixes(groups: list[tuple[int, int, int]], batch: int, block_size: int,
                       device, capacity: int | None = None) -> SharedPrefixes:
    """``prefix_groups``'s arrays as the tensors the kernels read, on ``device``. Groups come from
    ``shared_prefix_groups`` (2 rows or more, which the kernels' grid counts on); others are
    refused."""
    if any(rows < 2 for _, rows, _ in groups):
        raise ValueError(f"a group of fewer than 2 rows: {groups}")
    return prefix_groups(groups, batch, block_size, capacity).on_device(
        lambda a: torch.as_tensor(a, device=device))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q [R, H, D] against k, v [T, KVH, D] (in the dtype to compute in), all keys visible: (out
    [R, H, D], its natural-log-sum-exp [R, H]; -inf with no keys)."""
    group = q.size(1) // k.size(1)
    k, v = (x.repeat_interleave(group, 1) for x in (k, v))  # [T, H, D]
    s = torch.einsum("rhd,thd->rht", q.to(k.dtype), k) * scale
    if s.size(-1) == 0:
        return (torch.zeros(q.shape, dtype=k.dtype, device=q.device),
                torch.full(q.shape[:2], float("-inf"), dtype=k.dtype, device=q.device))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("rht,thd->rhd", torch.softmax(s, -1), v), lse


def cascade_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                             k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0, *,
                             prefixes: SharedPrefixes) -> torch.Tensor:
    """``reference.decode_attention`` (no window) computed as the cascade: each group's queries over
    its shared blocks at once, each row over the rest, merged by log-sum-exp."""
    if window:
        raise ValueError(f"cascade decode attention takes no sliding window (window={window})")
    batch, num_heads, head_dim = q.shape
    page = k_cache.size(1)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    tables = block_tables.clamp(min=0).long()
    k_all, v_all = (gather_blocks(c, tables, compute, s).flatten(1, 2)  # [B, T, KVH, D]
                    for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
    seq_shared = prefixes.seq_shared_len.tolist()
    out = torch.empty(batch, num_heads, head_dim, dtype=compute, device=q.device)
    lse = torch.empty(batch, num_heads, dtype=compute, device=q.device)
    for b, ctx in enumerate(context_lens.tolist()):
        out[b], lse[b] = (t[0] for t in _attend(q[b:b + 1], k_all[b, seq_shared[b]:ctx],
                                                v_all[b, seq_shared[b]:ctx], scale))
    for first, rows, shared in zip(*(t.tolist() for t in prefixes[:3])):
        if not rows:  # an empty group of a fixed capacity
            continue
        assert shared % page == 0 and shared <= min(seq_shared[first:first + rows])
        o_p, lse_p = _attend(q[first:first + rows], k_all[first, :shared], v_all[first, :shared],
                             scale)
        o_s, lse_s = out[first:first + rows], lse[first:first + rows]
        m = torch.maximum(lse_p, lse_s)
        w_p, w_s = torch.exp(lse_p - m), torch.exp(lse_s - m)
        out[first:first + rows] = ((o_p * w_p[..., None] + o_s * w_s[..., None])
                                   / (w_p + w_s)[..., None])
    return out.to(q.dtype)
