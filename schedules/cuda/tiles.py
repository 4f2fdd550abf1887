"""Tile shapes of the CUDA kernels and what they cost in shared memory.

Contents:
    CudaTiles          -- the knobs of a CUDA kernel (rows and keys per tile, splits, threads)
    WarpLayout         -- how a register-tile forward block spreads its rows and keys over warps
    forward_smem       -- shared-memory bytes of a forward (dense or paged) block
    backward_smem      -- shared-memory bytes of a backward block
    backward_strips, backward_registers -- the register-tile backward's warp fit and registers
    streaming_multiprocessors -- SM count of an architecture (how many blocks fill the GPU)
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from .device import HALF_TYPES, MMA, TILE_PAD, padded_dim


def _bytes(dtype: str) -> int:
    return 2 if dtype in HALF_TYPES else 4


@dataclass(frozen=True)
class CudaTiles:
    """``block_q`` task rows (query positions x heads of a GQA group) and ``block_k`` keys per
    tile; ``splits`` thread blocks share one row tile's keys (split-KV, merged by lse);
    ``threads`` per block; ``stages`` streamed tiles in flight (the ``cp.async`` pipeline of
    every kernel: the next tiles load while this one is computed; 1 loads each tile before use).
    Tensor-core kernels need multiples of 16 for both tile sizes."""

    block_q: int = 64
    block_k: int = 64
    splits: int = 1
    threads: int = 128
    stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "splits", "threads", "stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"CudaTiles: {name} must be >= 1, got {getattr(self, name)}")
        if self.threads % 32:
            raise ValueError(f"CudaTiles: threads must be a multiple of 32 (whole warps), got {self.threads}")

    def fits_tensor_cores(self) -> bool:
        return self.block_q % MMA == 0 and self.block_k % MMA == 0

    @property
    def warps(self) -> int:
        return self.threads // 32


@dataclass(frozen=True)
class WarpLayout:
    """A register-tile forward block's warps: ``row_warps`` x ``key_warps``. Warp (wm, wn) owns
    row strips wm * m_tiles .. (wm + 1) * m_tiles - 1 (16 rows each) and keys wn * key_slice ..
    of every key tile. Rows go first; warps left over split the keys (decode's single 16-row
    strip still keeps every warp busy), and their partial softmax states merge at the end."""

    row_warps: int
    key_warps: int
    m_tiles: int
    key_slice: int

    @staticmethod
    def of(tiles: CudaTiles) -> WarpLayout:
        strips = max(1, tiles.block_q // MMA)
        row_warps = gcd(tiles.warps, strips)
        key_warps = tiles.warps // row_warps
        return WarpLayout(row_warps, key_warps, strips // row_warps, tiles.block_k // key_warps)

    def problem(self, tiles: CudaTiles) -> str | None:
        """Why the tiles cannot be spread so (None when they can)."""
        if not tiles.fits_tensor_cores():
            return f"block_q {tiles.block_q} and block_k {tiles.block_k} must be multiples of 16 on tensor cores"
        if tiles.block_k % (MMA * self.key_warps):
            return (f"block_k {tiles.block_k} must split into {self.key_warps} key slices of a multiple of 16 "
                    f"({tiles.threads} threads over {tiles.block_q // MMA} row strips)")
        return None

    def registers(self, head_dim: int) -> int:
        """float32 accumulators per thread: its share of the warp's S and O fragments."""
        return self.m_tiles * (padded_dim(head_dim) + self.key_slice) // 2


def forward_smem(dtype: str, head_dim: int, tiles: CudaTiles) -> tuple[int, int]:
    """(static, dynamic) shared-memory bytes of a forward block: page ids (one set per stage) and
    row state static; Q, K and V tiles (``stages`` of each) dynamic. Float32 (SIMT) blocks also
    hold S, P and the rows' alpha, max and sum; register-tile (tensor-core) blocks none of them,
    but key-split warps merge their row max and sum (static) and O (float32, dynamic), and two
    int32 flags mark V tiles that held a NaN or Inf (static).

    The dynamic bytes are what the kernel launches with: TVM merges the dynamic buffers into one
    and lays the O-merge buffer over the tiles, dead by then, so a block needs the larger of the
    two, not their sum. An overcount here is not safe: a block whose dynamic bytes are counted
    past 48 KiB but are built within it cannot launch if its static bytes take it past 48 KiB
    (``rules.shared_memory_fits``; float16 decode at D 80 did so). The static bytes are a bound
    (TVM may lay the merge's row state over the page ids), which errs on the safe side."""
    BQ, BK, DP, e, ST = tiles.block_q, tiles.block_k, padded_dim(head_dim), _bytes(dtype), tiles.stages
    pad = TILE_PAD if dtype in HALF_TYPES else 0
    tiles_bytes = e * (BQ + 2 * BK * ST) * (DP + pad)
    if dtype in HALF_TYPES:
        key_warps = WarpLayout.of(tiles).key_warps
        merge = key_warps > 1
        static = 8 * BK * ST + (8 * key_warps * BQ if merge else 0) + 8
        return static, max(tiles_bytes, 4 * key_warps * BQ * DP if merge else 0)
    return 4 * BQ * (BK + 4) + e * BQ * BK + 4 * 3 * BQ + 8 * BK * ST, tiles_bytes


def backward_smem(dtype: str, head_dim: int, tiles: CudaTiles) -> tuple[int, int]:
    """(static, dynamic) bytes of a backward block: the rows' lse and D static (and on the SIMT
    path P and dS, float32; on tensor cores the int32 flags of tiles that held a NaN or Inf); Q,
    dO, K, V tiles dynamic (``stages`` of the pair a block streams: Q and dO in the dk/dv kernel,
    K and V in the dq kernel; the larger of the two)."""
    BQ, BK, DP, e, ST = tiles.block_q, tiles.block_k, padded_dim(head_dim), _bytes(dtype), tiles.stages
    registers = dtype in HALF_TYPES
    pad = TILE_PAD if registers else 0
    static = 8 * BQ + (8 if registers else 2 * 4 * BQ * BK)
    return static, e * max(2 * BQ * ST + 2 * BK, 2 * BQ + 2 * BK * ST) * (DP + pad)


def backward_strips(tiles: CudaTiles) -> str | None:
    """Why a register-tile backward cannot spread its tiles over the warps: every warp owns whole
    16-row strips of the block's keys (dk/dv kernel) and of its queries (dq kernel)."""
    if not tiles.fits_tensor_cores():
        return f"block_q {tiles.block_q} and block_k {tiles.block_k} must be multiples of 16 on tensor cores"
    for name in ("block_q", "block_k"):
        if getattr(tiles, name) // MMA % tiles.warps:
            return f"{name} {getattr(tiles, name)} has no whole 16-row strips for each of {tiles.warps} warps"
    return None


def backward_registers(head_dim: int, tiles: CudaTiles) -> int:
    """float32 fragment elements per thread of the larger backward kernel: dK, dV, S^T and dP^T of
    its key strips, or dQ, S and dP of its query strips."""
    DP, W = padded_dim(head_dim), tiles.warps
    key_strips, query_strips = tiles.block_k // MMA // W, tiles.block_q // MMA // W
    return max(key_strips * (DP + tiles.block_q), query_strips * (DP // 2 + tiles.block_k))


def streaming_multiprocessors(arch: str) -> int:
    """SMs of the data-center part of an architecture (A100: 108, H100/H200: 132)."""
    return {"sm_80": 108, "sm_90": 132}.get(arch, 80)


__all__ = ["CudaTiles", "WarpLayout", "backward_strips", "backward_registers", "forward_smem", "backward_smem",
           "streaming_multiprocessors"]
