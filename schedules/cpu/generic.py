"""Default llvm schedules for the rest of a model: the TIR functions that are not fuel kernels.

After ``LegalizeOps`` and ``FuseOps`` a model's projections, MLP, norms and RoPE are unscheduled
TIR: one scalar loop nest on one thread. These dlight rules (``apply(func, target, tunable)``
returns a schedule or None; ``tvm.s_tir.dlight.ApplyDefaultSchedule`` tries them in order and
skips functions already scheduled, such as the fuel kernels and MetaSchedule's tuned ones) give
every such function a parallel, vectorized loop nest. They work on symbolic shapes (a model's
batch and sequence length), where MetaSchedule cannot tune.

Contents:
    Matmul, PackedMatmul, DecodeMatmul (and their tiles, panel_cols) -- the matmul rules (``matmul``)
    Elementwise  -- functions of spatial blocks only (elementwise, broadcast, transpose, gather)
    ColumnReduction -- sums over outer axes (bias and norm-weight gradients): rows split per core
    RowReduction -- dlight's CPU reduction (norms, softmax rows)
    RULES        -- the rules in the order they are tried

Every rule returns None for a function it cannot schedule exactly (what TVM's own build of the
unscheduled loops computes, bit for bit but for the order of a sum and for a float32 sigmoid, whose
exp runs in vectors within a few ulp of libm's: ``rule_steps.with_vector_sigmoid``): a reduction
over size-1 axes (dlight counts it injective: none of its iterators reduces, but it still has an
init) is never inlined into or out of, and no bfloat16 constant is stored in vectors (TVM cannot
compile that).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl

from .matmul import DECODE_ROWS, DecodeMatmul, DecodeTiles, Matmul, MatmulTiles, PackedMatmul, panel_cols
from .rule_steps import inline_spatial, is_cpu, scheduled, stores_promoted_constant, with_vector_sigmoid
from .tiles import cores, vector_lanes


class Elementwise(dl.ScheduleRule):
    """Functions whose blocks are all spatial (elementwise ops, broadcasts, transposes, RoPE,
    gathers): producers inlined where they can be; then per remaining block the outer loops run
    fused in parallel, the innermost in vectors of ``lanes`` (when its extent is a known multiple)."""

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not is_cpu(target):
            return None
        return scheduled(self._schedule, func, vector_lanes(target))

    @staticmethod
    def _schedule(func: tirx.PrimFunc, lanes: int):
        sch = s_tir.Schedule(func)
        infos = dl.normalize_prim_func(sch)
        if infos is None or any(not info.is_injective() for info in infos):
            return None  # (a reduction over size-1 axes counts: it is left whole, in its own loops)
        infos = inline_spatial(sch, infos) or infos
        for info in infos:
            loops = sch.get_loops(info.block_rv)
            if not loops:
                continue
            # the innermost loop stays apart: fused with symbolic outer extents, its index would
            # need a division per lane and the vectors would turn into gathers
            *outer, inner = loops
            extent = sch.get(inner).extent
            if (isinstance(extent, tirx.IntImm) and extent.value % lanes == 0
                    and not stores_promoted_constant(sch, sch.get(info.block_rv))):
                _, lane = sch.split(inner, [None, lanes])
                sch.vectorize(lane)
                if outer:
                    sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
            else:
                sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])
        return with_vector_sigmoid(sch)


class ColumnReduction(dl.ScheduleRule):
    """A reduction over outer axes whose reads run contiguous along the output's innermost axis
    (a gradient's bias or norm weight: dy [N, C] summed over N). The plain loops, and dlight's
    row rule, walk each column down the rows: a cache line and, for wide rows, a page per element.
    Here the rows are split in one contiguous run per core (``rfactor``), each run summed row by
    row with the columns in vectors, then the runs' partial sums added per column in order
    (deterministic). An empty reduction writes 0 (its runs' partials start at 0)."""

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not is_cpu(target):
            return None
        return scheduled(self._schedule, func, vector_lanes(target), cores(target))

    @staticmethod
    def _schedule(func: tirx.PrimFunc, lanes: int, runs: int):
        sch = s_tir.Schedule(func)
        infos = dl.normalize_prim_func(sch)
        if infos is None:
            return None
        infos = inline_spatial(sch, infos) or infos
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
        if not isinstance(func, tirx.PrimFunc) or not is_cpu(target):
            return None
        return scheduled(self.rule.apply, func, target, tunable)


RULES = (PackedMatmul(), DecodeMatmul(), Matmul(), ColumnReduction(), RowReduction(), Elementwise())

__all__ = ["MatmulTiles", "Matmul", "PackedMatmul", "panel_cols", "DecodeTiles", "DecodeMatmul", "DECODE_ROWS",
           "Elementwise", "ColumnReduction", "RowReduction", "RULES"]
