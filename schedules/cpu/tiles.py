"""Tile configuration of the CPU kernels, and what the llvm target offers.

Contents:
    CpuTiles      -- frozen tile sizes of one kernel instance
    STREAMING_ROWS -- the most query rows per task that stream keys in place (decode)
    vector_lanes  -- float32 lanes of the target's widest vector unit (4, 8 or 16)
    vector_registers -- the target's architectural vector registers (16 or 32)
    tiles_for     -- the hand-picked tiles for a target, head dim and row count
    fit_keys, fit_rows -- tiles whose key tile (query tile) is no longer than a call's static key
                  (query) count needs
    tile_space, streaming_space -- the knob candidates the tuner samples
    cores         -- the target's thread count
    CORE_KNOBS    -- the knobs that set how many parallel tasks a kernel has (they depend on cores)
    nearest       -- the candidate nearest a value on a log scale (re-deriving a core knob)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import tvm


STREAMING_ROWS = 8  # at most this many rows per task: read K/V rows in place rather than packing tiles

# The knobs that set how many parallel tasks a kernel has, so their best value depends on the core
# count: the backward's splits (tasks = batch x KV heads x splits) and decode's KV heads per task
# (tasks = batch x KV heads / kv_heads). Every other knob shapes one task (tiles, vector width,
# prefetch) and depends on the instruction set and caches only. A tuning record holds these for
# its own target's core count; the rules re-derive them for another (``port_knobs``).
CORE_KNOBS = ("splits", "kv_heads")


@dataclass(frozen=True)
class CpuTiles:
    """Tile sizes; buffers per task are block_q x head_dim and block_k x head_dim, never Sq x Sk.

    block_q     rows (query position x head of the GQA group) one task owns
    block_k     keys per tile (the online softmax advances one tile at a time)
    micro_rows  rows of a register tile in the micro GEMMs
    key_vecs    vectors per register-tile row in the key-vectorized GEMMs (q.k^T, do.v^T)
    dim_vecs    vectors per register-tile row in the dim-vectorized GEMMs (p.v, ds.k, ...)
    lanes       float32 lanes of one vector register
    kv_heads    KV heads one decode task streams together (their rows of a page are contiguous)
    splits      backward: tasks per (batch, KV head), each over a contiguous share of the key tiles
    value_tokens  streaming decode: tokens whose value rows one accumulator pass adds (the
                accumulator is read and written once per pass)
    prefetch    streaming decode: software-prefetch the K/V rows of the token this many ahead (0: off)
    int16_dot   1 where the target multiplies int16 pairs into int32 lanes (x86 AVX2's vpmaddwd; not
                with AVX-512, unmeasured there): streaming decode over an int8 cache takes q.k in
                integers, and a few rows' float loops go two vectors wide (a target fact, not tuned)
    """

    block_q: int = 64
    block_k: int = 64
    micro_rows: int = 4
    key_vecs: int = 2
    dim_vecs: int = 2
    lanes: int = 8
    kv_heads: int = 1
    splits: int = 1
    value_tokens: int = 1
    prefetch: int = 0
    int16_dot: int = 0

    def __post_init__(self):
        if self.block_q % self.micro_rows:
            raise ValueError(f"CpuTiles: block_q {self.block_q} must be a multiple of micro_rows {self.micro_rows}")
        if self.block_k % (self.key_vecs * self.lanes):
            raise ValueError(f"CpuTiles: block_k {self.block_k} must be a multiple of key_vecs * lanes")
        if self.block_k % self.micro_rows:
            raise ValueError(f"CpuTiles: block_k {self.block_k} must be a multiple of micro_rows {self.micro_rows}")
        if min(self.block_q, self.block_k, self.micro_rows, self.key_vecs, self.dim_vecs, self.lanes, self.kv_heads,
               self.splits, self.value_tokens) < 1 or self.prefetch < 0:
            raise ValueError(f"CpuTiles: every tile size must be >= 1, got {self}")
        if self.int16_dot not in (0, 1):
            raise ValueError(f"CpuTiles: int16_dot must be 0 or 1, got {self.int16_dot}")

    def padded_dim(self, head_dim: int) -> int:
        """The head dim rounded up so dim-vectorized GEMMs need no tail."""
        width = self.dim_vecs * self.lanes
        return -(-head_dim // width) * width


def cores(target: tvm.target.Target) -> int:
    """The target's thread count (``num-cores``; 1 when unset)."""
    return int(target.attrs.get("num-cores", 0) or 1)


def nearest(value: float, candidates) -> int:
    """The candidate nearest ``value`` on a log scale (a tie goes to the larger): how a core knob
    scaled by a ratio of core counts lands on a point of the knob space."""
    value = max(float(value), 1e-9)
    return min(candidates, key=lambda c: (abs(math.log2(c / value)), -c))


def vector_lanes(target: tvm.target.Target) -> int:
    """16 with AVX-512, 8 with AVX2 (or any 256-bit unit), 4 otherwise (SSE/NEON baseline)."""
    if target.attrs.get("mcpu") is None:
        return 4  # plain "llvm" is the generic baseline CPU
    has = tvm.target.codegen.target_has_features
    if has("avx512f", target):
        return 16
    if has("avx2", target) or has("avx", target):
        return 8
    return 4


def vector_registers(target: tvm.target.Target) -> int:
    """Architectural vector registers: 32 with AVX-512 (zmm0-31), 16 otherwise on x86 (and assumed
    elsewhere)."""
    return 32 if vector_lanes(target) == 16 else 16


def tiles_for(target: tvm.target.Target, *, head_dim: int, rows: int | None, num_kv_heads: int = 1,
              batch: int | None = None, element_bytes: int = 4) -> CpuTiles:
    """Hand-picked tiles: 64 x 64 score tiles (they and a key tile fit a 32 KiB L1 in float32);
    64 x 128 with AVX-512, whose larger register tiles pay for the longer key tiles.

    ``rows`` (query positions x group heads, when static) shrinks block_q for decode, where a
    task streams ``kv_heads`` heads at once: enough tasks remain for every core, and each page
    row it reads is one contiguous run. All heads go to one task (whole page rows, the fastest
    read) unless a static ``batch`` smaller than the core count needs head chunks to fill cores.
    Decode prefetches the rows of the token ~64 KiB of the task's reads ahead (``element_bytes``:
    the cache's element size).
    """
    lanes = vector_lanes(target)
    # A register tile's accumulators fill about half the vector registers (the rest hold the
    # streamed vectors and broadcasts): 4 x 2 vectors with 16 registers, 8 x 2 with AVX-512's 32,
    # whose FMA latency needs the 16 independent chains (measured on Zen 5: 4 x 1 reached 54 % of
    # the FMA peak at hdim 128, 8 x 2 with 128-key tiles 75 %).
    wide = vector_registers(target) >= 32
    # measured on AVX2 (Zen 3) only; with AVX-512 the float path's FMAs are twice as wide
    int16_dot = int(lanes == 8 and tvm.target.codegen.target_has_features("avx2", target))
    tiles = CpuTiles(lanes=lanes, key_vecs=max(2, 16 // lanes), dim_vecs=2 if head_dim > lanes else 1,
                     micro_rows=8 if wide else 4, block_k=128 if wide else 64, int16_dot=int16_dot)
    if -(-head_dim // lanes) % tiles.dim_vecs:  # e.g. head dim 40 with 8 lanes: 5 vectors
        tiles = replace(tiles, dim_vecs=1)
    if rows is not None and rows <= STREAMING_ROWS:
        # decode rows stream their keys: a task holds exactly its rows (padding a group of 1 to 4 rows
        # quadrupled multi-head decode's FMAs; side by side on Zen 3, B8 H8 hdim 128, 4096 tokens:
        # bfloat16 8.2 -> 6.8 ms, int8 7.3 -> 4.6 ms), and loads and stores the accumulator once per
        # 4 value rows (~5 % on Zen 5). The GEMM paths given these rows (a dense call of <= 8 rows,
        # TVM-cache decode with in-kernel RoPE) take micro tiles of the largest power of two dividing them
        micro_rows = min(tiles.micro_rows, 4, rows & -rows)
        tiles = replace(tiles, micro_rows=micro_rows, block_q=rows, value_tokens=4)
    elif rows is not None and rows < tiles.block_q:
        tiles = replace(tiles, block_q=-(-rows // tiles.micro_rows) * tiles.micro_rows)
    threads = cores(target)
    chunks = 1 if batch is None or batch >= threads else min(num_kv_heads, -(-threads // batch))
    kv_heads = max(h for h in range(1, num_kv_heads // chunks + 1) if num_kv_heads % h == 0)
    tiles = replace(tiles, kv_heads=kv_heads)
    if rows is not None and rows <= STREAMING_ROWS:
        # measured on Zen 5 (B 8, Hkv 8, hdim 128, 4096 tokens): 16 tokens ahead in float32, 32 in
        # float16 read 5-30 % faster than the hardware prefetchers alone; nearer is slower
        row_bytes = kv_heads * head_dim * element_bytes
        tiles = replace(tiles, prefetch=max(4, min(64, (64 << 10) // row_bytes)))
    return tiles


def fit_keys(tiles: CpuTiles, keys: int | None) -> CpuTiles:
    """``tiles`` with block_k cut to ``keys`` (static; None: unknown) rounded up to what the kernels'
    key loops take at once: a call with few keys (Sk 1 at B 2048) packs and walks no key slots
    that no call has (64 per key, at block_k 64)."""
    if keys is None:
        return tiles
    if keys < tiles.key_vecs * tiles.lanes:  # fewer keys than a register tile's row: one vector of them
        tiles = replace(tiles, key_vecs=1)
    step = math.lcm(tiles.key_vecs * tiles.lanes, tiles.micro_rows)
    return replace(tiles, block_k=min(tiles.block_k, max(step, -(-keys // step) * step)))


def fit_rows(tiles: CpuTiles, rows: int | None) -> CpuTiles:
    """``tiles`` with block_q cut to ``rows`` (static; None: unknown) rounded up to a register tile
    (of fewer rows where ``rows`` is below one): a backward over one-row sequences computes one
    row per query tile, not 64."""
    if rows is None or rows >= tiles.block_q:
        return tiles
    micro_rows = min(tiles.micro_rows, 1 << (max(rows, 1).bit_length() - 1))
    return replace(tiles, micro_rows=micro_rows, block_q=max(micro_rows, -(-rows // micro_rows) * micro_rows))


def tile_space(target: tvm.target.Target, *, rows: int | None) -> dict[str, tuple[int, ...]]:
    """Candidates of the register-tiled kernels' knobs (the tuner skips invalid combinations).

    Vector widths up to the target's; score tiles 16-128 rows by 32-256 keys; register tiles of
    2-8 rows by 1-4 vectors. ``rows`` (static query rows of a task's KV head) caps block_q.
    """
    widest = vector_lanes(target)
    block_q = (16, 32, 64, 128)
    if rows is not None and rows < 64:
        block_q = tuple(sorted({-(-rows // 4) * 4, *(n for n in block_q if n < rows)}))
    return {
        "lanes": tuple(n for n in (4, 8, 16) if n <= widest),
        "block_q": block_q,
        "block_k": (32, 64, 128, 256),
        "micro_rows": (2, 4, 8),
        "key_vecs": (1, 2, 4),
        "dim_vecs": (1, 2, 4),
    }


def streaming_space(target: tvm.target.Target, *, num_kv_heads: int) -> dict[str, tuple[int, ...]]:
    """Candidates of the streaming decode kernel's knobs: key tile, KV heads per task, vector width,
    tokens per accumulator pass and software-prefetch distance."""
    widest = vector_lanes(target)
    return {
        "lanes": tuple(n for n in (4, 8, 16) if n <= widest),
        "block_k": (16, 32, 64, 128, 256),
        "kv_heads": tuple(h for h in range(1, num_kv_heads + 1) if num_kv_heads % h == 0),
        "value_tokens": (1, 2, 4),
        "prefetch": (0, 4, 8, 16, 32, 64),  # 4: the hand-picked floor, and in the shipped AVX2 logs
    }
