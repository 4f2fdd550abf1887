"""Default llvm schedules of a model's matmuls (nn.Linear, MLP, the output layer; batched and in any
layout), the dlight rules ``generic.RULES`` tries first.

Contents:
    MatmulTiles  -- the register tile of ``Matmul`` and ``PackedMatmul``
    Matmul       -- C[m, n] = sum_k A[m, k] B[n, k] (any batch dims, any layouts) + its fused epilogue
    panel_cols   -- the width of the panels a constant weight is laid out in (transform.PackLinearWeights)
    PackedMatmul -- Matmul over a weight already in panels [N / cols, K, cols]: no packing per call
    DecodeTiles  -- the accumulators of ``DecodeMatmul``
    DecodeMatmul -- Matmul at M 1 to ``DECODE_ROWS``, K contiguous (nn.Linear): B read once (a symbolic
                    M branches at run time to Matmul above ``DECODE_ROWS``)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu.matmul import get_index_map

from .rule_steps import (attempt, consumer_chain, gemm_block, inline_all_but_last, inline_producers, inlines_exactly,
                         is_cpu, normalize_gemm, scheduled, static_extent, writer)
from .tiles import vector_lanes, vector_registers


@dataclass(frozen=True)
class MatmulTiles:
    """``rows`` x ``vectors`` vectors of ``lanes`` float32 accumulate in registers while K streams.

    ``for_target``: 8 x 3 with AVX-512's 32 registers (24 accumulators, 3 of B, a broadcast), 4 x 3
    with 16 (12 accumulators). Side by side on a 2-vCPU Emerald Rapids at M 512 over SmolLM's
    shapes, 8 x 3 ran at 266-301 GFLOP/s where 4 x 2, 6 x 4 and 12 x 2 ran at 221-261 (FMA probe
    ~400); built for AVX2 there, 4 x 3 ran at 159-178 against 4 x 2's 136-162."""

    rows: int = 4
    vectors: int = 2
    lanes: int = 8

    @property
    def cols(self) -> int:
        return self.vectors * self.lanes

    @classmethod
    def for_target(cls, target: tvm.target.Target) -> "MatmulTiles":
        lanes = vector_lanes(target)
        return cls(rows=8 if vector_registers(target) >= 32 else 4, vectors=3, lanes=lanes)


class Matmul(dl.ScheduleRule):
    """A GEMM-like reduction (dlight's ``get_index_map`` accepts it) with spatial prologues that
    inline and a chain of spatial epilogues (bias, residual add, SiLU-gating, casts).

    Normalized as dlight's GPU matmul does: A, B and C reindexed to [S, M, K], [S, N, K] and
    [S, M, N] (batch dims fused into M, however the buffers are laid out), M and N padded to the
    register tile so the hot loop has no predicate. Then, per N tile of ``cols`` (in parallel):
    B's [K, cols] slice is packed contiguous (each tile of C walks it in order), and each ``rows`` x
    ``cols`` tile of C accumulates in registers over K (a broadcast of A times a vector of B per
    FMA), its epilogue applied as it is stored. A is read in place, or copied once into the padded
    [M, K] buffer.
    """

    def __init__(self, tiles: MatmulTiles | None = None):
        self.tiles = tiles

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not is_cpu(target):
            return None
        tiles = self.tiles or MatmulTiles.for_target(target)
        return scheduled(self._schedule, func, tiles)

    @staticmethod
    def _schedule(func: tirx.PrimFunc, tiles: MatmulTiles):
        sch = s_tir.Schedule(func)
        main = gemm_block(sch)
        if main is None or get_index_map(sch.get(main)) is None:
            return None
        c_map = normalize_gemm(sch, main)
        k_extent = sch.get(main).iter_vars[3].dom.extent
        if not isinstance(k_extent, tirx.IntImm):
            return None  # the packed B tile is [K, cols]: K must be known
        return _register_tiled(sch, main, c_map, tiles, b_in_panels=False)


def _copies_in_place(sch: s_tir.Schedule, block) -> bool:
    """``block`` stores a plain load (a reindex copy pad_einsum did not pad: inlined, the hot loop
    reads the source where it lies; a padded copy's predicate stays out of the loop)."""
    stmt = sch.get(block)
    return inlines_exactly(sch, block) and isinstance(stmt.body.value, tvm.ir.expr.TensorLoad)


A_BLOCK_BYTES = 5 << 18  # rows of A (float32) that stay in a 2 MiB L2 (Sapphire and Emerald Rapids) beside a
# panel of B; TVM's target carries no cache sizes
MANY_PANELS = 64  # the output layer's N: re-reading each panel once per block of A is cheap


def _a_block_tiles(m_tiles: int | None, n_tiles: int | None, k: int | None, tiles: MatmulTiles) -> int | None:
    """M tiles per block of A, where A is too large for L2 and N has ``MANY_PANELS``: each task (a
    panel) walked all of A, streaming it from L3 once per panel. With 2048 x 576 x 49152 (the output
    layer at batch 4) on a 2-vCPU Emerald Rapids: 246 GFLOP/s, 315 in blocks of 512 rows (260 in
    blocks of 1024); with 12 panels (K 1536, N 576) blocks ran slower (328 to 217). None: no blocks
    (symbolic M, few panels, or A fits)."""
    if None in (m_tiles, n_tiles, k) or n_tiles < MANY_PANELS:
        return None
    row_bytes = tiles.rows * k * 4
    if m_tiles * row_bytes <= A_BLOCK_BYTES:
        return None
    block = 1
    while m_tiles % (2 * block) == 0 and 2 * block * row_bytes <= A_BLOCK_BYTES:
        block *= 2
    return block if block < m_tiles else None


def _register_tiled(sch: s_tir.Schedule, main, c_map, tiles: MatmulTiles, *, b_in_panels: bool):
    """The normalized [S, M, N, K] GEMM ``main`` in ``tiles``: per N tile of ``cols`` (the tasks, in
    parallel) each ``rows`` x ``cols`` tile of C accumulates in registers over K, its epilogue chain
    applied as it is stored. B is read where its copy reads it when ``b_in_panels`` (already laid
    out in [N / cols, K, cols] panels), else packed per task."""
    sch.pad_einsum(main, [1, tiles.rows, tiles.cols, 1])
    batch, m, n, k = sch.get_loops(main)
    m_tile, m_row = sch.split(m, [None, tiles.rows])
    n_tile, n_vec, n_lane = sch.split(n, [None, tiles.vectors, tiles.lanes])
    block_tiles = _a_block_tiles(*(static_extent(sch.get(loop).extent) for loop in (m_tile, n_tile, k)), tiles)
    if block_tiles is None:
        sch.reorder(batch, n_tile, m_tile, k, m_row, n_vec, n_lane)
        task = sch.fuse(batch, n_tile)
    else:  # rows of A in blocks that stay in L2 while a core's tasks walk the panels
        m_block, m_tile = sch.split(m_tile, [None, block_tiles])
        sch.reorder(batch, m_block, n_tile, m_tile, k, m_row, n_vec, n_lane)
        task = sch.fuse(batch, m_block, n_tile)
    sch.parallel(task)

    a_copy = writer(sch, main, 0)  # the reindex copy (padded where M needs it)
    if not inline_producers(sch, a_copy):
        return None
    if not (_copies_in_place(sch, a_copy) and attempt(sch.compute_inline, a_copy)):
        *rows, _ = sch.get_loops(a_copy)  # padded: one pass over A, rows in parallel (a parallel
        sch.parallel(sch.fuse(*rows) if len(rows) > 1 else rows[0])  # K loop: a launch per row)

    b_tile = writer(sch, main, 1)
    if not inline_producers(sch, b_tile):
        return None
    if b_in_panels:
        if not (inlines_exactly(sch, b_tile) and attempt(sch.compute_inline, b_tile)):
            return None
    else:  # B's [K, cols] slice, per task
        sch.compute_at(b_tile, task)
        sch.set_scope(b_tile, 0, "local")
        sch.transform_layout(b_tile, ("write", 0), lambda s, j, kk: (s, kk, j))

    chain = consumer_chain(sch, main)  # unpad, un-reindex, the model's epilogue
    if not inline_all_but_last(sch, chain):
        return None
    store = chain[-1]
    sch.transform_block_layout(store, c_map)
    sch.reverse_compute_at(store, m_tile)
    sch.set_scope(main, 0, "local")  # the C tile: registers
    _, store_lane = sch.split(sch.get_loops(store)[-1], [None, tiles.lanes])
    sch.vectorize(store_lane)

    sch.unroll(m_row)
    sch.unroll(n_vec)
    sch.vectorize(n_lane)
    sch.decompose_reduction(main, k)
    return sch


# ---- weights in panels: nn.Linear's matmul over a weight laid out at build ---------------------------------------
# ``transform.PackLinearWeights`` lays a constant weight w [N, K] out as panels wp [N / cols, K, cols]
# when it builds (``PANEL_LAYOUT``), and the NT_matmul reads ``wp[n // cols, k, n % cols]``: ``Matmul``'s
# register tile then reads B where it lies, with no packing at each call. At M 1 (dlight's GEMV form)
# and at a static M below the tile's rows, the tile has M rows: the panels stream once.


def panel_cols(n: int, target: tvm.target.Target) -> int | None:
    """The width of the panels a weight of ``n`` rows (output features) is laid out in for
    ``PackedMatmul`` on ``target``: the register tile's columns, else 2 or 1 vectors where those
    divide ``n``; None where no vector width does."""
    tiles = MatmulTiles.for_target(target)
    return next((v * tiles.lanes for v in (tiles.vectors, 2, 1) if n % (v * tiles.lanes) == 0), None)


def _panel_read(sch: s_tir.Schedule, main) -> tuple[int, int] | None:
    """(index, cols) of ``main``'s read of a weight in panels (``wp[n // cols, k, n % cols]``, n a
    spatial and k the reduced iterator), where it reads exactly one; else None."""
    block = sch.get(main)
    spatial = [v.var for v in block.iter_vars if v.iter_type == tirx.IterVar.DataPar]
    reduced = [v.var for v in block.iter_vars if v.iter_type != tirx.IterVar.DataPar]
    analyzer = tvm.sym.Analyzer()
    for v in block.iter_vars:  # a single panel's n // cols was simplified to 0
        analyzer.bind(v.var, v.dom)
    found = []
    for index, region in enumerate(block.reads):
        shape = region.source.shape
        cols = static_extent(shape[-1]) if len(shape) == 3 else None
        if cols is None or len(reduced) != 1:
            continue
        tile, k, col = (r.min for r in region.region)
        if not (isinstance(k, tirx.Var) and k.same_as(reduced[0])):
            continue
        if any(analyzer.can_prove_equal(tile, tirx.floordiv(n, cols))
               and analyzer.can_prove_equal(col, tirx.floormod(n, cols)) for n in spatial):
            found.append((index, cols))
    return found[0] if len(found) == 1 else None


class PackedMatmul(Matmul):
    """nn.Linear's matmul over a weight in panels (``transform.PackLinearWeights``): ``Matmul``'s
    register tile reading the panels in place, at any M and its epilogue chain fused; declines every
    function that reads no weight in panels.

    At a symbolic M (weight parameters packed at load, ``PackLinearParams``: a decode step's batch
    varies) the function branches at run time, as ``DecodeMatmul``'s: up to ``DECODE_ROWS`` rows
    the tile is one row (the panels stream once, no padded rows computed), beyond it ``rows``."""

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool):
        larger = super().apply(func, target, _tunable)
        rows = _symbolic_rows(func) if larger is not None else None
        if rows is None:
            return larger
        tiles = self.tiles or MatmulTiles.for_target(target)
        decode = scheduled(self._schedule, func, replace(tiles, rows=1))
        return None if decode is None else _branch_on_rows(rows, decode, larger)

    @staticmethod
    def _schedule(func: tirx.PrimFunc, tiles: MatmulTiles):
        sch = s_tir.Schedule(func)
        main = gemm_block(sch)
        found = None if main is None else _panel_read(sch, main)
        if found is None:
            return None
        index, cols = found
        if cols % tiles.lanes:
            return None
        tiles = replace(tiles, vectors=cols // tiles.lanes)
        if len(sch.get(main).iter_vars) == 2:  # M = 1, normalized to [N, K] (a GEMV)
            return PackedMatmul._gemv(sch, main, tiles)
        sch.reindex(main, ("read", index))  # w[n, k] as the normalization reads B (inlined back)
        if get_index_map(sch.get(main)) is None:
            return None
        c_map = normalize_gemm(sch, main)
        m = static_extent(sch.get(main).iter_vars[1].dom.extent)
        if m is not None and m < tiles.rows:
            tiles = replace(tiles, rows=m)  # decode: one tile of M rows, the panels read once
        return _register_tiled(sch, main, c_map, tiles, b_in_panels=True)

    @staticmethod
    def _gemv(sch: s_tir.Schedule, main, tiles: MatmulTiles):
        """One row: per panel (the tasks), ``vectors`` accumulators over K, the epilogue as it is stored."""
        n, k = sch.get_loops(main)
        n_tile, n_vec, n_lane = sch.split(n, [None, tiles.vectors, tiles.lanes])
        sch.reorder(n_tile, k, n_vec, n_lane)
        sch.parallel(n_tile)
        chain = consumer_chain(sch, main)
        if not inline_all_but_last(sch, chain):
            return None
        if chain:
            store = chain[-1]
            sch.reverse_compute_at(store, n_tile)
            sch.set_scope(main, 0, "local")
            _, store_lane = sch.split(sch.get_loops(store)[-1], [None, tiles.lanes])
            sch.vectorize(store_lane)
        sch.unroll(n_vec)
        sch.vectorize(n_lane)
        sch.decompose_reduction(main, k)
        return sch


# ---- decode: a few rows of x against a weight read once ---------------------------------------------------------
# ``Matmul`` packs B into panels for its register tile: right for prefill, where each weight element
# meets hundreds of rows, but at M 1-8 the packing and the padded rows are the work (a decode row ran
# at 1-4 GB/s). ``DecodeMatmul``: per tile of ``cols`` output columns (the tasks, in parallel) the rows
# of w stream once in vectors along K, each vector multiplied into ``rows`` accumulators; a tile of
# M > ``rows`` reads its w slice again from L1. Each accumulator's lanes are summed at the end of
# the tile (the order of the sum differs from TVM's build; the terms are the same).

DECODE_ROWS = 8  # beyond, each w element meets enough rows for Matmul's packed panels


@dataclass(frozen=True)
class DecodeTiles:
    """``rows`` x ``cols`` accumulators of ``lanes``. On a 2-vCPU Emerald Rapids (AVX-512) 2 x 4 read
    the weight at the read probe's rate at M 1-4 (16 accumulators spilled at M 8); ``lanes`` comes
    from the target."""

    rows: int = 2
    cols: int = 4
    lanes: int = 8


def _symbolic_rows(func: tirx.PrimFunc) -> tirx.PrimExpr | None:
    """M of ``func``'s GEMM, the product of its output C [..., N]'s leading dims (batch dims times
    rows, as ``normalize_gemm`` fuses them), where that is not a constant; None where it is."""
    sch = s_tir.Schedule(func)
    main = gemm_block(sch)
    if main is None:
        return None
    shape = sch.get(main).writes[0].source.shape[:-1]
    if all(static_extent(d) is not None for d in shape):
        return None
    return tvm.sym.Analyzer().simplify(functools.reduce(lambda a, b: a * b, shape))


def _branch_on_rows(rows: tirx.PrimExpr, decode: s_tir.Schedule, larger: s_tir.Schedule) -> s_tir.Schedule:
    """One function that runs ``decode``'s schedule where ``rows`` <= ``DECODE_ROWS`` and
    ``larger``'s beyond (two schedules of the same function, decided at run time)."""
    small, big = decode.mod["main"], larger.mod["main"]
    return s_tir.Schedule(small.with_body(tirx.IfThenElse(rows <= DECODE_ROWS, small.body, big.body)))


def _last_index_is(block: tirx.SBlock, buffer: tirx.Buffer, var: tirx.Var) -> bool:
    """``block`` reads ``buffer`` with ``var`` alone as its last index (contiguous along ``var``)."""
    regions = [r for r in block.reads if r.source.same_as(buffer)]
    return (len(regions) == 1 and regions[0].region[-1].min.same_as(var)
            and static_extent(regions[0].region[-1].extent) == 1)


class DecodeMatmul(dl.ScheduleRule):
    """nn.Linear's matmul (x [.., M, K] times w [N, K], K contiguous in both, after the same
    normalization as ``Matmul``) at a static M of 1 to ``DECODE_ROWS`` or a symbolic M, with its
    spatial epilogue chain; declines anything else (``Matmul`` takes it).

    At a symbolic M (a decode step over a batch that varies, as MLC-LLM's ``batch_decode`` and
    ``LlamaEngine``'s decode are exported) the function branches at run time: M up to
    ``DECODE_ROWS`` takes this rule's loop nest one row at a time, a larger M ``Matmul``'s schedule
    of the same function (both declined or neither). Matmul alone packs the whole weight into
    panels at every call: a decode step of SmolLM's output layer (1 x 576 x 49152) took 13.5 ms
    with it, 3.9 with the branch (torch 2.9); the branch runs as fast as a build at that static M."""

    def __init__(self, tiles: DecodeTiles | None = None, matmul_tiles: MatmulTiles | None = None):
        self.tiles, self.matmul_tiles = tiles, matmul_tiles

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not is_cpu(target):
            return None
        tiles = self.tiles or DecodeTiles(lanes=vector_lanes(target))
        decode = scheduled(self._schedule, func, tiles)
        rows = _symbolic_rows(func) if decode is not None else None
        if rows is None:
            return decode
        larger = Matmul(self.matmul_tiles).apply(func, target, _tunable)
        return None if larger is None else _branch_on_rows(rows, decode, larger)

    @staticmethod
    def _schedule(func: tirx.PrimFunc, tiles: DecodeTiles):
        sch = s_tir.Schedule(func)
        main = gemm_block(sch)
        if main is None:
            return None
        symbolic = False
        if get_index_map(sch.get(main)) is None:  # M = 1: normalized to [N, K] (a GEMV), or no matmul
            rows, c_map = 1, None
            if len(sch.get(main).iter_vars) != 2 or not DecodeMatmul._reads_along_k(sch, main, copies=()):
                return None
        else:
            normalized = DecodeMatmul._normalize(sch, main, tiles)
            if normalized is None:
                return None
            rows, c_map = normalized
            symbolic = static_extent(sch.get(main).iter_vars[1].dom.extent) is None
        n, k = (static_extent(v.dom.extent) for v in sch.get(main).iter_vars[-2:])
        if k is None or k % tiles.lanes or n is None:
            return None
        cols = next(c for c in (tiles.cols, 2, 1) if n % c == 0)

        *outer, n_loop, k_loop = sch.get_loops(main)
        n_tile, n_col = sch.split(n_loop, [None, cols])
        k_step, k_lane = sch.split(k_loop, [None, tiles.lanes])
        if outer:  # [1, M, N, K]: M in tiles of ``rows``
            b_loop, m_loop = outer
            m_tile, m_row = sch.split(m_loop, [None, rows])
            sch.reorder(b_loop, n_tile, m_tile, k_step, m_row, n_col, k_lane)
        else:
            sch.reorder(n_tile, k_step, n_col, k_lane)
        name = sch.get(main).name_hint
        partial = sch.rfactor(k_lane, 0)  # per lane of K: [lanes, (1, M,) N], summed after the tile
        main = sch.get_sblock(name)  # the sum over the lanes (the RV now names the rfactor block,
        loops = sch.get_loops(partial)  # and the loops split above are the sum's)
        task = sch.fuse(*loops[:2]) if outer else loops[0]
        sch.parallel(task)
        anchor = sch.get_loops(partial)[1] if symbolic else task  # a symbolic M: per row, not all of M
        sch.set_scope(partial, 0, "local")
        ndim = len(sch.get(partial).writes[0].source.shape)
        sch.transform_layout(partial, ("write", 0), tirx.IndexMap.from_func(lambda *i: (*i[1:], i[0]), ndim=ndim))
        sch.reverse_compute_at(main, anchor)  # the lanes' sum, per tile
        chain = consumer_chain(sch, main)  # un-reindex, the model's epilogue
        if chain:
            if not inline_all_but_last(sch, chain):
                return None
            store = chain[-1]
            if c_map is not None:
                sch.transform_block_layout(store, c_map)
            sch.reverse_compute_at(store, anchor)
            sch.set_scope(main, 0, "local")
        # [task, (m_tile,) k_step, (m_row,) n_col, k_lane]
        loops = sch.get_loops(partial)
        sch.vectorize(loops[-1])
        for unrolled in loops[-3 if outer else -2:-1]:
            sch.unroll(unrolled)
        init = sch.decompose_reduction(partial, loops[-4 if outer else -3])
        sch.vectorize(sch.get_loops(init)[-1])
        return sch

    @staticmethod
    def _normalize(sch: s_tir.Schedule, main, tiles: DecodeTiles):
        """``main`` as [1, M, N, K] (``Matmul``'s normalization) reading x and w in place: (its M
        tile, the map of C's store), or None where M is not static up to ``DECODE_ROWS`` or x or w
        is not contiguous along K."""
        c_map = normalize_gemm(sch, main)
        batch, m = (static_extent(v.dom.extent) for v in sch.get(main).iter_vars[:2])
        if batch != 1 or (m is not None and not 1 <= m <= DECODE_ROWS):
            return None
        copies = [sch.get(main).reads[i].source for i in (0, 1)]
        for copy in (writer(sch, main, 0), writer(sch, main, 1)):
            if not (inline_producers(sch, copy) and inlines_exactly(sch, copy) and attempt(sch.compute_inline, copy)):
                return None
        if not DecodeMatmul._reads_along_k(sch, main, copies):
            return None
        return (tiles.rows if m is not None and m % tiles.rows == 0 else 1), c_map

    @staticmethod
    def _reads_along_k(sch: s_tir.Schedule, main, copies) -> bool:
        """``main`` reads two buffers, none of ``copies``, each with the reduced var alone as its last index."""
        block = sch.get(main)
        k_var = block.iter_vars[-1].var
        inputs = [r.source for r in block.reads]
        return len(inputs) == 2 and all(_last_index_is(block, buffer, k_var) for buffer in inputs) and \
            not any(buffer.same_as(copy) for buffer in inputs for copy in copies)
