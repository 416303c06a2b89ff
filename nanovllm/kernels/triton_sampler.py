"""Plain batches' sampling (a temperature per row, 0 greedy) as Gumbel-max, argmax(logits / T + G),
with in-kernel Philox noise, one read of the logits; the structured-output bitmask; a stream's wait
for a pinned host flag."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_score(row_ptr, offs, vocab_size, inv_t, r, SAMPLED: tl.constexpr):
    x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("inf"))  # NaN scores +inf: a row with either is marked -1
    if SAMPLED:
        # u in (0, 1) strictly, 23 random bits centred in their bucket: u = 1 would give G = +inf
        u = ((r >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        x = x * inv_t - tl.log(-tl.log(u))
    return tl.max(x, 0, return_indices=True)


@triton.jit
def _chunk_best(row_ptr, base, vocab_size, inv_t, r0, r1, r2, r3, QUARTER: tl.constexpr,
                SAMPLED: tl.constexpr):
    """The best score of logits [base, base + 4 * QUARTER) and its offset; strictly greater wins
    (ties: lowest id)."""
    q = tl.arange(0, QUARTER)
    best, idx = _chunk_score(row_ptr, base + q, vocab_size, inv_t, r0, SAMPLED)
    v, i = _chunk_score(row_ptr, base + QUARTER + q, vocab_size, inv_t, r1, SAMPLED)
    idx = tl.where(v > best, QUARTER + i, idx)
    best = tl.maximum(best, v)
    v, i = _chunk_score(row_ptr, base + 2 * QUARTER + q, vocab_size, inv_t, r2, SAMPLED)
    idx = tl.where(v > best, 2 * QUARTER + i, idx)
    best = tl.maximum(best, v)
    v, i = _chunk_score(row_ptr, base + 3 * QUARTER + q, vocab_size, inv_t, r3, SAMPLED)
    idx = tl.where(v > best, 3 * QUARTER + i, idx)
    return tl.maximum(best, v), idx


@triton.jit(do_not_specialize=["seed"])
def _sample_chunks_kernel(logits_ptr, stride, temperatures_ptr, seed, vals_ptr, idx_ptr, vocab_size,
                          NUM_CHUNKS: tl.constexpr, QUARTER: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    t = tl.load(temperatures_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    base = chunk * 4 * QUARTER
    if t > 0:
        q = tl.arange(0, QUARTER)
        r0, r1, r2, r3 = tl.randint4x(seed, (row * NUM_CHUNKS + chunk) * QUARTER + q)
        best, idx = _chunk_best(row_ptr, base, vocab_size, 1.0 / t, r0, r1, r2, r3, QUARTER, True)
    else:  # greedy: no noise
        best, idx = _chunk_best(row_ptr, base, vocab_size, 1.0, 0, 0, 0, 0, QUARTER, False)
    tl.store(vals_ptr + row * NUM_CHUNKS + chunk, best)
    tl.store(idx_ptr + row * NUM_CHUNKS + chunk, base + idx)


@triton.jit
def _pick_chunk_kernel(vals_ptr, idx_ptr, out_ptr, NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    vals = tl.load(vals_ptr + row * NUM_CHUNKS + c, mask=c < NUM_CHUNKS, other=float("-inf"))
    top, best = tl.max(vals, 0, return_indices=True)
    token = tl.load(idx_ptr + row * NUM_CHUNKS + best).to(tl.int64)
    tl.store(out_ptr + row, tl.where(top == float("inf"), -1, token))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int,
           quarter: int = 1024) -> torch.Tensor:
    """Token ids [B] int64 for logits [B, V], temperatures [B] float32; ties go to the lowest id, as
    ``torch.argmax``; -1 for a row with a NaN or +inf logit. ``seed`` (below 2**63) keys the noise:
    a new one for every draw."""
    batch, vocab_size = logits.shape
    assert logits.stride(1) == 1 and temperatures.numel() == batch and 0 <= seed < 2 ** 63
    quarter = min(quarter, max(16, triton.next_power_of_2(triton.cdiv(vocab_size, 4))))
    num_chunks = triton.cdiv(vocab_size, 4 * quarter)
    assert batch * num_chunks * quarter < 2 ** 31  # the Philox counter is int32
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    vals = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    _sample_chunks_kernel[(batch, num_chunks)](
        logits, logits.stride(0), temperatures, seed, vals, idx, vocab_size, NUM_CHUNKS=num_chunks,
        QUARTER=quarter)
    _pick_chunk_kernel[(batch,)](vals, idx, out, NUM_CHUNKS=num_chunks,
                                 BLOCK=max(2, triton.next_power_of_2(num_chunks)))
    return out


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, stride_l, bitmask_ptr, stride_b, vocab_size,
                                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab_size
    words = tl.load(bitmask_ptr + row * stride_b + offs // 32, mask=in_vocab, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_l + offs, float("-inf"), mask=in_vocab & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        block: int = 4096) -> torch.Tensor:
    """Sets logits [B, V] to -inf in place where bit t % 32 of int32 ``bitmask[b, t // 32]`` is
    clear."""
    batch, vocab_size = logits.shape
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.size(0) >= batch
    assert bitmask.size(1) * 32 >= vocab_size and bitmask.dtype == torch.int32
    if batch:
        _apply_token_bitmask_kernel[(batch, triton.cdiv(vocab_size, block))](
            logits, logits.stride(0), bitmask, bitmask.stride(0), vocab_size, BLOCK=block)
    return logits


# polls of the host's flag (each a PCIe read) before a waiting kernel gives up
MAX_POLLS = 1 << 25


@triton.jit(do_not_specialize=["ticket", "max_polls"])
def _wait_for_flag_kernel(flag_ptr, gave_up_ptr, ticket, max_polls):
    seen = tl.load(flag_ptr, volatile=True)
    polls = 0
    while (seen < ticket) & (polls < max_polls):
        seen = tl.load(flag_ptr, volatile=True)
        polls += 1
    if seen < ticket:
        tl.store(gave_up_ptr, ticket)


def wait_for_flag(flag: torch.Tensor, gave_up: torch.Tensor, ticket: int,
                  max_polls: int = MAX_POLLS) -> None:
    """Holds the current stream until pinned int64 ``flag[0]`` reaches ``ticket``; after
    ``max_polls`` reads it goes on, writing ``ticket`` into pinned ``gave_up[0]``, so a silent host
    cannot hang it."""
    assert flag.dtype == gave_up.dtype == torch.int64 and flag.numel() >= 1 and gave_up.numel() >= 1
    _wait_for_flag_kernel[(1,)](flag, gave_up, ticket, max_polls, num_warps=1)
