"""What the default llvm rules (``generic``, ``matmul``) share: recognizing a function's blocks and the
schedule steps that keep a rule exact (inline only what computes the same, decline where a primitive
refuses).

Contents:
    is_cpu, scheduled -- a rule's target test, and its schedule or None where a primitive refused
    inlines_exactly, inline_spatial, inline_producers, inline_all_but_last, attempt -- exact inlining
    stores_promoted_constant -- a block that TVM's bfloat16 legalization cannot vectorize
    consumer_chain, writer, gemm_block, normalize_gemm -- a GEMM's blocks, normalized to [S, M, N, K]
    static_extent -- an extent as an int, None where it is symbolic
    with_vector_sigmoid -- a schedule whose float32 sigmoids of a load vectorize (fast_exp, not libm)
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu.matmul import get_index_map

from tvm_fuel.op import semantics as sem


def is_cpu(target: tvm.target.Target) -> bool:
    return target.kind.name == "llvm"


# dtypes TVM's llvm pipeline computes in float32 (BF16ComputeLegalize, FP8ComputeLegalize)
_PROMOTED = ("bfloat16", "float8", "float6", "float4")


def _promoted(dtype) -> bool:
    return str(dtype).startswith(_PROMOTED)


def _reduces(stmt) -> bool:
    """A reduction block, also one whose reduced axes all had extent 1 (normalized away, its init kept)."""
    return stmt.init is not None or any(v.iter_type != tirx.IterVar.DataPar for v in stmt.iter_vars)


def inlines_exactly(sch: s_tir.Schedule, block) -> bool:
    """``compute_inline(block)`` computes what the stored intermediate held: the block is one store, no
    reduction (a reduction over size-1 axes inlined would drop its init)."""
    stmt = sch.get(block)
    return isinstance(stmt.body, tirx.BufferStore) and not _reduces(stmt)


def _reverse_inlines_exactly(sch: s_tir.Schedule, block) -> bool:
    """``reverse_compute_inline(block)`` keeps the epilogue apart from any update: no producer reduces
    (inlined into a reduction over size-1 axes, x - mean(x) became x - (acc + x) from x - 0)."""
    return inlines_exactly(sch, block) and all(inlines_exactly(sch, p) for p in sch.get_producers(block))


def _spatial(sch: s_tir.Schedule, info) -> bool:
    return info.is_injective() and not _reduces(sch.get(info.block_rv))


def attempt(primitive, block) -> bool:
    try:
        primitive(block)
    except Exception:  # noqa: BLE001 -- the primitive refused (the schedule is left as it was)
        return False
    return True


def inline_spatial(sch: s_tir.Schedule, infos: list | None) -> list | None:
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
        done = next((i for i, info in enumerate(blocks) if inlines_exactly(sch, info.block_rv)
                     and attempt(sch.compute_inline, info.block_rv)), None)
        if done is None:
            done = next((i for i, info in enumerate(blocks) if _reverse_inlines_exactly(sch, info.block_rv)
                         and attempt(sch.reverse_compute_inline, info.block_rv)), None)
        if done is None:
            return blocks
        blocks.pop(done)


def stores_promoted_constant(sch: s_tir.Schedule, stmt) -> bool:
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
                                                if stores_promoted_constant(sch, b) else None))

    tvm_ffi.structural_walk(sch.mod["main"].body, (tirx.For, loop))
    return bool(found)


def _checked(sch: s_tir.Schedule | None) -> s_tir.Schedule | None:
    """A rule's schedule, or None where TVM could not compile it."""
    return None if sch is None or _vectorizes_promoted_constant(sch) else sch


def scheduled(schedule, *args) -> s_tir.Schedule | None:
    """``schedule(*args)`` (``_checked``), or None where one of its primitives refused: the function
    is not the rule's pattern (a layout the normalization cannot express, a block that does not
    compute-at)."""
    try:
        return _checked(schedule(*args))
    except Exception:  # noqa: BLE001 -- a primitive refusing this function: not this rule's pattern
        return None


def consumer_chain(sch: s_tir.Schedule, block) -> list | None:
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


def inline_all_but_last(sch: s_tir.Schedule, chain: list) -> bool:
    """Each block of an epilogue ``chain`` but its last (the store) inlined, each where that is
    exact; False where one is left."""
    return all(inlines_exactly(sch, block) and attempt(sch.compute_inline, block) for block in chain[:-1])


def writer(sch: s_tir.Schedule, block, read_index: int):
    buffer = sch.get(block).reads[read_index].source
    return next(b for b in sch.get_producers(block) if sch.get(b).writes[0].source.same_as(buffer))


def inline_producers(sch: s_tir.Schedule, block) -> bool:
    """Inline the blocks before ``block`` (its reindex copy), each where that is exact; False where one is left."""
    while sch.get_producers(block):
        producer = sch.get_producers(block)[0]
        if not (inlines_exactly(sch, producer) and attempt(sch.compute_inline, producer)):
            return False
    return True


def gemm_block(sch: s_tir.Schedule):
    """The function's one reduction, its spatial prologues inlined and a chain of spatial epilogues
    after it (``_consumer_chain``); None for any other function."""
    infos = inline_spatial(sch, dl.normalize_prim_func(sch))
    if not infos:
        return None
    reductions = [info for info in infos if info.is_reduction()]
    if len(reductions) != 1 or infos[0] is not reductions[0]:
        return None  # a prologue that did not inline, or a second reduction
    main = reductions[0].block_rv
    return None if consumer_chain(sch, main) is None else main


def normalize_gemm(sch: s_tir.Schedule, main):
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

def static_extent(value) -> int | None:
    return int(value) if isinstance(value, tirx.IntImm) else None


_SIGMOID = tvm.ir.Op.get("tirx.sigmoid")
_EXP_OVERFLOW = 88.72283935546875  # above it float32 exp is inf


def _sigmoid_of_load(node):
    """``sigmoid(x)`` as ``1 / (1 + exp(-x))`` over ``semantics.fast_exp`` (a few ulp of libm's expf),
    which overflows to inf as expf does: 0 at -inf, 1 at inf, NaN for NaN. Only for a float32 load
    (fast_exp reads its argument many times)."""
    if not (node.op.same_as(_SIGMOID) and str(node.ty.dtype) == "float32"
            and isinstance(node.args[0], tvm.ir.expr.TensorLoad)):
        return node
    minus = -node.args[0]
    exp = tirx.Select(minus > tirx.const(_EXP_OVERFLOW, "float32"), tirx.const(float("inf"), "float32"),
                      sem.fast_exp(minus))
    one = tirx.const(1.0, "float32")
    return one / (one + exp)


def with_vector_sigmoid(sch: s_tir.Schedule) -> s_tir.Schedule:
    """``sch``'s function with each float32 ``sigmoid`` of a load computed in vectors: LLVM lowers a
    vector ``exp`` to one libm call per lane, and the SiLU-gating of a SmolLM-shaped MLP (x * sigmoid(x)
    * up, 512 x 1536) took 1.8 ms of a 170 ms model call. The result is within a few ulp of the libm
    sigmoid (``test_generic_differential``'s float32 tolerance is 64)."""
    func = sch.mod["main"]
    body = tvm_ffi.structural_map(func.body, (tvm.ir.expr.Call, _sigmoid_of_load))
    return sch if body.same_as(func.body) else s_tir.Schedule(func.with_body(body))
