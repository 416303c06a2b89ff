"""The persistent decode kernel's schedule in plain Python: a layer's stages, each stage's tasks, which program runs
which task, and the grid barrier that ends each stage. ``triton_decode`` takes its numbers from here and computes
the same formulas on the device; the tests run this protocol with Python threads as the programs.

A layer is five stages, each ending when every program has arrived at the barrier's counter:
  qkv        tiles of BLOCK_N output columns: RMSNorm of the residual stream, then x @ W_qkv.T
  attention  (sequence, KV head, split) tasks: q/k norm and rotary, the new K/V into the cache, a split of the
             context; the split that arrives last at its (sequence, KV head) counter merges the splits
  o_proj     (tile, K split) tasks; the split that arrives last at its tile's counter adds the partial sums and
             the residual
  gate_up    tiles: RMSNorm, then SiLU(x @ W_gate.T) * (x @ W_up.T)
  down_proj  (tile, K split) tasks, merged as o_proj's

The projections' weights are in the model's dtype or fp8 (``fp8``): "block", a checkpoint's e4m3 weights with a
scale per ``weight_block_size`` block, the activations quantized per row and block (so a load of K columns, and a
K split, holds whole blocks, or all of K); or "channel", ``quantization="fp8"``'s weights with a scale per output
channel, the activations quantized to e4m3 per token (their amax gathered by the stage that writes them).
"""
from __future__ import annotations

from dataclasses import dataclass

STAGES = ("qkv", "attention", "o_proj", "gate_up", "down_proj")
BLOCK_N = 16  # tl.dot's smallest tile
BLOCK_M = 16  # rows (sequences) a tile computes: the largest batch the kernel runs
MAX_ATTENTION_SPLITS = 32
MAX_BLOCK_K = 512
MAX_SPLITS = 4
FP8_FORMATS = (None, "block", "channel")


def _block_k(k: int) -> int:
    """The largest power of two up to MAX_BLOCK_K that divides k: a task's weights in as few loads as may be."""
    block = MAX_BLOCK_K
    while k % block:
        block //= 2
    return block


def _splits(tiles: int, num_programs: int, k: int, granule: int = 16) -> int:
    """K splits of a projection: the fewest loads a task, then the most tasks, up to one per program; a split's
    columns a multiple of ``granule`` (block-wise fp8: whole blocks, as x is quantized per block)."""
    fits = [s for s in range(1, MAX_SPLITS + 1) if s == 1 or (tiles * s <= num_programs and k % (granule * s) == 0)]
    return min(fits, key=lambda s: (k // s // _block_k(k // s), -s))


@dataclass(frozen=True)
class DecodePlan:
    num_programs: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    o_splits: int
    down_splits: int
    fp8: str | None = None  # FP8_FORMATS
    weight_block_size: tuple[int, int] | None = None  # fp8 "block": the rows and columns one scale covers

    @classmethod
    def build(cls, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
              num_programs: int, fp8: str | None = None,
              weight_block_size: tuple[int, int] | None = None) -> DecodePlan:
        q_size = num_heads * head_dim
        for name, n in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                        ("num_heads * head_dim", q_size)):
            if n % BLOCK_N:
                raise ValueError(f"{name} {n} is not a multiple of {BLOCK_N}")
        if fp8 not in FP8_FORMATS:
            raise ValueError(f"fp8={fp8!r} is not one of {FP8_FORMATS}")
        if fp8 == "block":
            bn, bk = weight_block_size or (0, 0)
            if bn < 1 or bk < 16 or bk & (bk - 1):
                raise ValueError(f"the persistent decode kernel reads fp8 weight_block_size {weight_block_size}: "
                                 "its columns (the second) must be a power of two >= 16, its rows >= 1")
        elif weight_block_size is not None:
            raise ValueError(f"weight_block_size {weight_block_size} is for fp8='block' only, not fp8={fp8!r}")
        tiles = hidden_size // BLOCK_N
        granule = max(16, weight_block_size[1]) if fp8 == "block" else 16
        return cls(num_programs, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
                   _splits(tiles, num_programs, q_size, granule),
                   _splits(tiles, num_programs, intermediate_size, granule), fp8,
                   None if weight_block_size is None else tuple(weight_block_size))

    def stage_k(self, stage: str) -> int:
        """A stage's K: the columns of its projection's weights."""
        return {"o_proj": self.num_heads * self.head_dim, "down_proj": self.intermediate_size}.get(stage,
                                                                                                    self.hidden_size)

    def block_k(self, stage: str) -> int:
        """The K columns of one load of a task's weights (a power of two, as a block's columns are)."""
        k = self.stage_k(stage) // {"o_proj": self.o_splits, "down_proj": self.down_splits}.get(stage, 1)
        return min(_block_k(k), 256) if stage == "gate_up" else _block_k(k)  # two tiles: registers for 256

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def attention_splits(self, batch: int) -> int:
        """Context splits of each (sequence, KV head): about one task per program."""
        return max(1, min(MAX_ATTENTION_SPLITS, self.num_programs // (batch * self.num_kv_heads)))

    def num_tasks(self, stage: str, batch: int) -> int:
        tiles = self.hidden_size // BLOCK_N
        return {"qkv": self.qkv_size // BLOCK_N,
                "attention": batch * self.num_kv_heads * self.attention_splits(batch),
                "o_proj": tiles * self.o_splits,
                "gate_up": self.intermediate_size // BLOCK_N,
                "down_proj": tiles * self.down_splits}[stage]

    def splits(self, stage: str, batch: int) -> int:
        """How many tasks share one merge counter (1: no merge)."""
        return {"attention": self.attention_splits(batch), "o_proj": self.o_splits,
                "down_proj": self.down_splits}.get(stage, 1)

    def tasks_of(self, program: int, stage: str, batch: int) -> range:
        """Program ``program`` runs tasks program, program + P, ... of a stage."""
        return range(program, self.num_tasks(stage, batch), self.num_programs)

    def barrier_target(self, layer: int, stage: int) -> int:
        """The barrier counter (zeroed before the launch, one arrival per program and stage) once every program
        has ended stage ``stage`` of layer ``layer``."""
        return (layer * len(STAGES) + stage + 1) * self.num_programs

    def num_counters(self, batch: int) -> int:
        """The sync buffer: the barrier counter, the timeout flag, then the merge counters (the attention's per
        (sequence, KV head), reused by o_proj and down_proj per tile)."""
        return 2 + max(batch * self.num_kv_heads, self.hidden_size // BLOCK_N)
