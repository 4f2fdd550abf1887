"""Default llvm schedules for the rest of a model: the TIR functions that are not fuel kernels.

After ``LegalizeOps`` and ``FuseOps`` a model's projections, MLP, norms and RoPE are unscheduled
TIR: one scalar loop nest on one thread. These dlight rules (``apply(func, target, tunable)``
returns a schedule or None; ``tvm.s_tir.dlight.ApplyDefaultSchedule`` tries them in order and
skips functions already scheduled, such as the fuel kernels and MetaSchedule's tuned ones) give
every such function a parallel, vectorized loop nest. They work on symbolic shapes (a model's
batch and sequence length), where MetaSchedule cannot tune.

Contents:
    MatmulTiles  -- the register tile of ``Matmul``
    Matmul       -- C[m, n] = sum_k A[m, k] B[n, k] (any batch dims, any layouts) + its fused epilogue
    DecodeTiles  -- the accumulators of ``DecodeMatmul``
    DecodeMatmul -- Matmul at a static M of 1 to ``DECODE_ROWS``, K contiguous (nn.Linear): B read once
    Elementwise  -- functions of spatial blocks only (elementwise, broadcast, transpose, gather)
    ColumnReduction -- sums over outer axes (bias and norm-weight gradients): rows split per core
    RowReduction -- dlight's CPU reduction (norms, softmax rows)
    RULES        -- the rules in the order they are tried

Every rule returns None for a function it cannot schedule exactly (what TVM's own build of the
unscheduled loops computes, bit for bit but for the order of a sum): a reduction over size-1 axes
(dlight counts it injective: none of its iterators reduces, but it still has an init) is never
inlined into or out of, and no bfloat16 constant is stored in vectors (TVM cannot compile that).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu.matmul import get_index_map

from .tiles import cores, vector_lanes


@dataclass(frozen=True)
class MatmulTiles:
    """``rows`` x ``vectors`` vectors of ``lanes`` float32 accumulate in registers while K streams.

    4 x 2 vectors reach ~400 GFLOP/s (fp32) on 2 Zen 5 cores at M 1000, N 192-512, K 192-512;
    8 x 2 measured the same within noise and pads decode's few rows further."""

    rows: int = 4
    vectors: int = 2
    lanes: int = 8

    @property
    def cols(self) -> int:
        return self.vectors * self.lanes


def _is_cpu(target: tvm.target.Target) -> bool:
    return target.kind.name == "llvm"


# dtypes TVM's llvm pipeline computes in float32 (BF16ComputeLegalize, FP8ComputeLegalize)
_PROMOTED = ("bfloat16", "float8", "float6", "float4")


def _promoted(dtype) -> bool:
    return str(dtype).startswith(_PROMOTED)


def _reduces(stmt) -> bool:
    """A reduction block, also one whose reduced axes all had extent 1 (normalized away, its init kept)."""
    return stmt.init is not None or any(v.iter_type != tirx.IterVar.DataPar for v in stmt.iter_vars)


def _inlines_exactly(sch: s_tir.Schedule, block) -> bool:
    """``compute_inline(block)`` computes what the stored intermediate held: the block is one store, no
    reduction (a reduction over size-1 axes inlined would drop its init)."""
    stmt = sch.get(block)
    return isinstance(stmt.body, tirx.BufferStore) and not _reduces(stmt)


def _reverse_inlines_exactly(sch: s_tir.Schedule, block) -> bool:
    """``reverse_compute_inline(block)`` keeps the epilogue apart from any update: no producer reduces
    (inlined into a reduction over size-1 axes, x - mean(x) became x - (acc + x) from x - 0)."""
    return _inlines_exactly(sch, block) and all(_inlines_exactly(sch, p) for p in sch.get_producers(block))


def _spatial(sch: s_tir.Schedule, info) -> bool:
    return info.is_injective() and not _reduces(sch.get(info.block_rv))


def _try(primitive, block) -> bool:
    try:
        primitive(block)
    except Exception:  # noqa: BLE001 -- the primitive refused (the schedule is left as it was)
        return False
    return True


def _inline_spatial(sch: s_tir.Schedule, infos: list | None) -> list | None:
    """dlight's ``try_inline_contiguous_spatial`` (each run of spatial blocks inlined where it can be,
    the blocks left returned in order), inlining only where that is exact (``_inlines_exactly``)."""
    if infos is None:
        return None
    remaining, run = [], []
    for info in infos:
        if _spatial(sch, info):
            run.append(info)
            continue
        remaining += _inline_run(sch, run) + [info]
        run = []
    return remaining + _inline_run(sch, run)


def _inline_run(sch: s_tir.Schedule, blocks: list) -> list:
    blocks = list(blocks)
    while True:
        done = next((i for i, info in enumerate(blocks) if _inlines_exactly(sch, info.block_rv)
                     and _try(sch.compute_inline, info.block_rv)), None)
        if done is None:
            done = next((i for i, info in enumerate(blocks) if _reverse_inlines_exactly(sch, info.block_rv)
                         and _try(sch.reverse_compute_inline, info.block_rv)), None)
        if done is None:
            return blocks
        blocks.pop(done)


def _stores_promoted_constant(sch: s_tir.Schedule, stmt) -> bool:
    """The block (or its init) stores a constant of a promoted dtype into a parameter: vectorized,
    TVM's bfloat16 storage legalization fails on the broadcast (``dtype mismatch on BufferStore``;
    a buffer inside the function is float32 by then)."""
    params = sch.mod["main"].params
    return any(isinstance(s, tirx.BufferStore) and isinstance(s.value, tirx.FloatImm) and _promoted(s.value.ty)
               and any(s.buffer.same_as(p) for p in params) for s in (stmt.body, stmt.init))


def _vectorizes_promoted_constant(sch: s_tir.Schedule) -> bool:
    found = []

    def loop(node):
        if node.kind == tirx.ForKind.VECTORIZED:
            tvm_ffi.structural_walk(node.body, (s_tir.SBlock, lambda b: found.append(b)
                                                if _stores_promoted_constant(sch, b) else None))

    tvm_ffi.structural_walk(sch.mod["main"].body, (tirx.For, loop))
    return bool(found)


def _checked(sch: s_tir.Schedule | None) -> s_tir.Schedule | None:
    """A rule's schedule, or None where TVM could not compile it."""
    return None if sch is None or _vectorizes_promoted_constant(sch) else sch


def _scheduled(schedule, *args) -> s_tir.Schedule | None:
    """``schedule(*args)`` (``_checked``), or None where one of its primitives refused: the function
    is not the rule's pattern (a layout the normalization cannot express, a block that does not
    compute-at)."""
    try:
        return _checked(schedule(*args))
    except Exception:  # noqa: BLE001 -- a primitive refusing this function: not this rule's pattern
        return None


def _consumer_chain(sch: s_tir.Schedule, block) -> list | None:
    """The blocks after ``block``, when each has one consumer and all are spatial (an epilogue; a
    reduction over size-1 axes is none)."""
    chain = []
    while True:
        consumers = sch.get_consumers(block)
        if not consumers:
            return chain
        if len(consumers) > 1:
            return None
        block = consumers[0]
        if _reduces(sch.get(block)):
            return None
        chain.append(block)


def _writer(sch: s_tir.Schedule, block, read_index: int):
    buffer = sch.get(block).reads[read_index].source
    return next(b for b in sch.get_producers(block) if sch.get(b).writes[0].source.same_as(buffer))


def _inline_producers(sch: s_tir.Schedule, block) -> bool:
    """Inline the blocks before ``block`` (its reindex copy), each where that is exact; False where one is left."""
    while sch.get_producers(block):
        producer = sch.get_producers(block)[0]
        if not (_inlines_exactly(sch, producer) and _try(sch.compute_inline, producer)):
            return False
    return True


def _gemm_block(sch: s_tir.Schedule):
    """The function's one reduction, its spatial prologues inlined and a chain of spatial epilogues
    after it (``_consumer_chain``); None for any other function."""
    infos = _inline_spatial(sch, dl.normalize_prim_func(sch))
    if not infos:
        return None
    reductions = [info for info in infos if info.is_reduction()]
    if len(reductions) != 1 or infos[0] is not reductions[0]:
        return None  # a prologue that did not inline, or a second reduction
    main = reductions[0].block_rv
    return None if _consumer_chain(sch, main) is None else main


def _normalize_gemm(sch: s_tir.Schedule, main):
    """``main`` (``get_index_map`` accepts it) as dlight's GPU matmul normalizes it: A, B and C
    reindexed to [S, M, N, K]-ordered copies, the block's iterators [S, M, N, K]; the map of C's."""
    a_copy, b_copy, c_copy = (sch.reindex(main, ("read", 0)), sch.reindex(main, ("read", 1)),
                              sch.reindex(main, ("write", 0)))
    block_map, a_map, b_map, c_map = get_index_map(sch.get(main))
    sch.transform_layout(a_copy, ("write", 0), a_map)
    sch.transform_layout(b_copy, ("write", 0), b_map)
    sch.transform_layout(c_copy, ("read", 0), c_map)
    sch.transform_block_layout(main, block_map)
    return c_map


class Matmul(dl.ScheduleRule):
    """A GEMM-like reduction (dlight's ``get_index_map`` accepts it) with spatial prologues that
    inline and a chain of spatial epilogues (bias, residual add, SiLU-gating, casts).

    Normalized as dlight's GPU matmul does: A, B and C reindexed to [S, M, K], [S, N, K] and
    [S, M, N] (batch dims fused into M, however the buffers are laid out), M and N padded to the
    register tile so the hot loop has no predicate. Then, per N tile of ``cols`` (in parallel):
    B's [K, cols] slice is packed contiguous (it stays in L1), and each ``rows`` x ``cols`` tile of C
    accumulates in registers over K (a broadcast of A times a vector of B per FMA), its epilogue
    applied as it is stored. A is copied once into the padded [M, K] buffer.
    """

    def __init__(self, tiles: MatmulTiles | None = None):
        self.tiles = tiles

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not _is_cpu(target):
            return None
        tiles = self.tiles or MatmulTiles(lanes=vector_lanes(target))
        return _scheduled(self._schedule, func, tiles)

    @staticmethod
    def _schedule(func: tirx.PrimFunc, tiles: MatmulTiles):
        sch = s_tir.Schedule(func)
        main = _gemm_block(sch)
        if main is None or get_index_map(sch.get(main)) is None:
            return None
        c_map = _normalize_gemm(sch, main)
        k_extent = sch.get(main).iter_vars[3].dom.extent
        if not isinstance(k_extent, tirx.IntImm):
            return None  # the packed B tile is [K, cols]: K must be known
        sch.pad_einsum(main, [1, tiles.rows, tiles.cols, 1])

        batch, m, n, k = sch.get_loops(main)
        m_tile, m_row = sch.split(m, [None, tiles.rows])
        n_tile, n_vec, n_lane = sch.split(n, [None, tiles.vectors, tiles.lanes])
        sch.reorder(batch, n_tile, m_tile, k, m_row, n_vec, n_lane)
        task = sch.fuse(batch, n_tile)
        sch.parallel(task)

        a_pad = _writer(sch, main, 0)  # the reindex copy (padded where M needs it): one pass over A
        if not _inline_producers(sch, a_pad):
            return None
        *rows, _ = sch.get_loops(a_pad)  # rows in parallel (a parallel K loop: a launch per row)
        sch.parallel(sch.fuse(*rows) if len(rows) > 1 else rows[0])

        b_tile = _writer(sch, main, 1)  # B's [K, cols] slice, per task
        if not _inline_producers(sch, b_tile):
            return None
        sch.compute_at(b_tile, task)
        sch.set_scope(b_tile, 0, "local")
        sch.transform_layout(b_tile, ("write", 0), lambda s, j, kk: (s, kk, j))

        chain = _consumer_chain(sch, main)  # unpad, un-reindex, the model's epilogue
        for block in chain[:-1]:
            if not (_inlines_exactly(sch, block) and _try(sch.compute_inline, block)):
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


def _extent(value) -> int | None:
    return int(value) if isinstance(value, tirx.IntImm) else None


def _last_index_is(block: tirx.SBlock, buffer: tirx.Buffer, var: tirx.Var) -> bool:
    """``block`` reads ``buffer`` with ``var`` alone as its last index (contiguous along ``var``)."""
    regions = [r for r in block.reads if r.source.same_as(buffer)]
    return len(regions) == 1 and regions[0].region[-1].min.same_as(var) and _extent(regions[0].region[-1].extent) == 1


class DecodeMatmul(dl.ScheduleRule):
    """nn.Linear's matmul (x [.., M, K] times w [N, K], K contiguous in both, after the same
    normalization as ``generic.Matmul``) at a static M of 1 to ``DECODE_ROWS``, with its spatial
    epilogue chain; declines anything else (``generic.Matmul`` takes it)."""

    def __init__(self, tiles: DecodeTiles | None = None):
        self.tiles = tiles

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not _is_cpu(target):
            return None
        tiles = self.tiles or DecodeTiles(lanes=vector_lanes(target))
        return _scheduled(self._schedule, func, tiles)

    @staticmethod
    def _schedule(func: tirx.PrimFunc, tiles: DecodeTiles):
        sch = s_tir.Schedule(func)
        main = _gemm_block(sch)
        if main is None:
            return None
        if get_index_map(sch.get(main)) is None:  # M = 1: normalized to [N, K] (a GEMV), or no matmul
            rows, c_map = 1, None
            if len(sch.get(main).iter_vars) != 2 or not DecodeMatmul._reads_along_k(sch, main, copies=()):
                return None
        else:
            normalized = DecodeMatmul._normalize(sch, main, tiles)
            if normalized is None:
                return None
            rows, c_map = normalized
        n, k = (_extent(v.dom.extent) for v in sch.get(main).iter_vars[-2:])
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
        sch.set_scope(partial, 0, "local")
        ndim = len(sch.get(partial).writes[0].source.shape)
        sch.transform_layout(partial, ("write", 0), tirx.IndexMap.from_func(lambda *i: (*i[1:], i[0]), ndim=ndim))
        sch.reverse_compute_at(main, task)  # the lanes' sum, per tile
        chain = _consumer_chain(sch, main)  # un-reindex, the model's epilogue
        if chain:
            for block_rv in chain[:-1]:
                if not (_inlines_exactly(sch, block_rv) and _try(sch.compute_inline, block_rv)):
                    return None
            store = chain[-1]
            if c_map is not None:
                sch.transform_block_layout(store, c_map)
            sch.reverse_compute_at(store, task)
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
        c_map = _normalize_gemm(sch, main)
        batch, m = (_extent(v.dom.extent) for v in sch.get(main).iter_vars[:2])
        if batch != 1 or m is None or not 1 <= m <= DECODE_ROWS:
            return None
        copies = [sch.get(main).reads[i].source for i in (0, 1)]
        for copy in (_writer(sch, main, 0), _writer(sch, main, 1)):
            if not (_inline_producers(sch, copy) and _inlines_exactly(sch, copy) and _try(sch.compute_inline, copy)):
                return None
        if not DecodeMatmul._reads_along_k(sch, main, copies):
            return None
        return (tiles.rows if m % tiles.rows == 0 else 1), c_map

    @staticmethod
    def _reads_along_k(sch: s_tir.Schedule, main, copies) -> bool:
        """``main`` reads two buffers, none of ``copies``, each with the reduced var alone as its last index."""
        block = sch.get(main)
        k_var = block.iter_vars[-1].var
        inputs = [r.source for r in block.reads]
        return len(inputs) == 2 and all(_last_index_is(block, buffer, k_var) for buffer in inputs) and \
            not any(buffer.same_as(copy) for buffer in inputs for copy in copies)


class Elementwise(dl.ScheduleRule):
    """Functions whose blocks are all spatial (elementwise ops, broadcasts, transposes, RoPE,
    gathers): producers inlined where they can be; then per remaining block the outer loops run
    fused in parallel, the innermost in vectors of ``lanes`` (when its extent is a known multiple)."""

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not _is_cpu(target):
            return None
        return _scheduled(self._schedule, func, vector_lanes(target))

    @staticmethod
    def _schedule(func: tirx.PrimFunc, lanes: int):
        sch = s_tir.Schedule(func)
        infos = dl.normalize_prim_func(sch)
        if infos is None or any(not info.is_injective() for info in infos):
            return None  # (a reduction over size-1 axes counts: it is left whole, in its own loops)
        infos = _inline_spatial(sch, infos) or infos
        for info in infos:
            loops = sch.get_loops(info.block_rv)
            if not loops:
                continue
            # the innermost loop stays apart: fused with symbolic outer extents, its index would
            # need a division per lane and the vectors would turn into gathers
            *outer, inner = loops
            extent = sch.get(inner).extent
            if (isinstance(extent, tirx.IntImm) and extent.value % lanes == 0
                    and not _stores_promoted_constant(sch, sch.get(info.block_rv))):
                _, lane = sch.split(inner, [None, lanes])
                sch.vectorize(lane)
                if outer:
                    sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
            else:
                sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])
        return sch


class ColumnReduction(dl.ScheduleRule):
    """A reduction over outer axes whose reads run contiguous along the output's innermost axis
    (a gradient's bias or norm weight: dy [N, C] summed over N). The plain loops, and dlight's
    row rule, walk each column down the rows: a cache line and, for wide rows, a page per element.
    Here the rows are split in one contiguous run per core (``rfactor``), each run summed row by
    row with the columns in vectors, then the runs' partial sums added per column in order
    (deterministic). An empty reduction writes 0 (its runs' partials start at 0)."""

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not _is_cpu(target):
            return None
        return _scheduled(self._schedule, func, vector_lanes(target), cores(target))

    @staticmethod
    def _schedule(func: tirx.PrimFunc, lanes: int, runs: int):
        sch = s_tir.Schedule(func)
        infos = dl.normalize_prim_func(sch)
        if infos is None:
            return None
        infos = _inline_spatial(sch, infos) or infos
        reductions = [info for info in infos if info.is_reduction()]
        if len(reductions) != 1 or not all(info.is_injective() for info in infos if info is not reductions[0]):
            return None
        block = reductions[0].block_rv
        stmt = sch.get(block)
        spatial = [v.var.name for v in stmt.iter_vars if v.iter_type == tirx.IterVar.DataPar]
        reduced = {v.var.name for v in stmt.iter_vars if v.iter_type == tirx.IterVar.CommReduce}
        if not spatial or not reduced:
            return None

        def names(expr) -> set[str]:
            return {v.name for v in tirx.analysis.undefined_vars(expr)}

        # the reads that vary along both the reduced rows and the innermost column (not a per-row
        # statistic nor a per-column weight) must be contiguous along that column
        streams = [read for read in stmt.reads if read.region and {spatial[-1]} <= set().union(
            *(names(r.min) for r in read.region)) and reduced & set().union(*(names(r.min) for r in read.region))]
        if not streams or any(names(read.region[-1].min) != {spatial[-1]} for read in streams):
            return None  # a row reduction (contiguous along the reduced axis), or no column to vectorize
        kinds = [it.kind for it in reductions[0].iters]
        loops = sch.get_loops(block)
        rows = [loop for loop, kind in zip(loops, kinds) if kind == "R"]
        rows = sch.fuse(*rows) if len(rows) > 1 else rows[0]
        run, _ = sch.split(rows, [runs, None])
        partial = sch.rfactor(run, factor_axis=0)
        *columns, p_run, step = sch.get_loops(partial)
        sch.reorder(p_run, step, *columns)
        ColumnReduction._vectorize_columns(sch, columns, lanes)
        sch.parallel(p_run)
        sch.decompose_reduction(partial, step)
        *columns, w_run = sch.get_loops(block)  # the write-back: column chunks in parallel, runs in order
        ColumnReduction._vectorize_columns(sch, columns, lanes, runs_loop=w_run)
        return sch

    @staticmethod
    def _vectorize_columns(sch: s_tir.Schedule, columns: list, lanes: int, runs_loop=None) -> None:
        """The innermost column loop in vectors where its extent is a known multiple of ``lanes``;
        with ``runs_loop`` (the write-back's), the other column loops fused in parallel outside it."""
        *outer, inner = columns
        extent = sch.get(inner).extent
        if isinstance(extent, tirx.IntImm) and extent.value % lanes == 0:
            chunk, lane = sch.split(inner, [None, lanes])
            if runs_loop is not None:
                sch.reorder(*outer, chunk, runs_loop, lane)
                sch.parallel(sch.fuse(*outer, chunk) if outer else chunk)
            sch.vectorize(lane)
        elif runs_loop is not None:
            sch.parallel(sch.fuse(*columns) if len(columns) > 1 else columns[0])


class RowReduction(dl.ScheduleRule):
    """dlight's CPU reduction rule (norms, softmax rows: spatial rows in parallel, the reduced
    axis vectorized), for llvm targets."""

    def __init__(self):
        self.rule = dl.cpu.Reduction()

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not _is_cpu(target):
            return None
        return _scheduled(self.rule.apply, func, target, tunable)


RULES = (DecodeMatmul(), Matmul(), ColumnReduction(), RowReduction(), Elementwise())

__all__ = ["MatmulTiles", "Matmul", "DecodeTiles", "DecodeMatmul", "DECODE_ROWS", "Elementwise", "ColumnReduction",
           "RowReduction", "RULES"]
