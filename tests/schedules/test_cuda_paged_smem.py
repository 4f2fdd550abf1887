"""The CUDA paged attention's shared memory, measured on what TVM builds (no GPU, no nvcc needed).

TVM 0.27's runtime raises a kernel's dynamic shared-memory limit only for more than 48 KiB of
dynamic bytes, so a block with static + dynamic > 48 KiB and dynamic <= 48 KiB cannot launch
(``tests.helpers.launchable``). The rule picks its tiles by ``forward_smem``'s estimate; here the
paged kernels it builds over a pairwise covering array of head dims 40-256, float16, bfloat16 and
float32, decode and a few query rows, GQA groups 1, 4, 7, block sizes 16 and 32 (each with decode
rows and with more), sm_80 and sm_90, are measured after TVM merges its dynamic buffers into the
one it launches with (``MergeSharedMemoryAllocations``): the block can be launched, its dynamic bytes are the estimate's
and its static bytes within it. Before the merge (what ``nvcc.build_with_shared_memory`` reports)
the dynamic bytes are only a bound, and the launch rule cannot use a bound: more dynamic bytes can
make a block launchable.

The defect this guards: the estimate added the register-tile decode's O-merge buffer to the K/V
tiles, but TVM lays it over them (dead by then), so float16/bfloat16 decode at D 80 (16 x 64 tiles,
two stages) was counted at 1544 + 68352 bytes (launchable) and built with 1288 + 47872 (not).
"""

from __future__ import annotations

import warnings

import pytest
import tvm
from covering import pairwise
from helpers import applied_knobs, build, launchable
from tvm import tirx
from tvm.ir.instrument import pass_instrument

import tvm_fuel
from tvm_fuel import op
from tvm_fuel.diagnostics import FloorWarning
from tvm_fuel.dispatch import workload_of
from tvm_fuel.schedules import rule_for
from tvm_fuel.schedules.cuda.tiles import CudaTiles, forward_smem

pytestmark = pytest.mark.integration

ARCHS = ("sm_80", "sm_90")
HEAD_DIMS = (40, 64, 72, 80, 96, 112, 128, 160, 192, 256)  # 72: padded to 80 as well
# (block size, GQA group, Sq): rows = group x Sq; up to 16 rows are one decode tile, 28 are not
FEW = ((16, 4, 1), (32, 7, 4))
# each block size with decode rows (1, 4, 7; 16 as 4 x 4) and with rows past a decode tile (28): the
# knobs follow the block size and the rows; the full product of the three took 6 minutes
ALL = ((16, 1, 1), (32, 4, 1), (16, 7, 1), (32, 1, 4), (16, 4, 4), (32, 7, 4))
DECODE_KNOBS = dict(block_q=16, block_k=64, stages=2, threads=128)  # the hand-picked decode tile where it fits
TUNED_D128 = dict(block_q=16, block_k=16, splits=4, stages=1, threads=32)  # the H200 record (tuning_logs/cuda-sm90)


def _target(arch: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": arch})


def _paged(dtype, d, block_size, group, sq, *, kv_heads=2, batch=2, num_blocks=None, max_blocks=None,
           causal=True) -> tvm.IRModule:
    nb = num_blocks or tirx.Var("num_blocks", "int64")
    mb = max_blocks or tirx.Var("max_blocks", "int64")
    cache = ((nb, block_size, kv_heads, d), dtype)
    params = dict(q=((batch, kv_heads * group, sq, d), dtype), k_cache=cache, v_cache=cache,
                  block_table=((batch, mb), "int32"), context_lens=((batch,), "int32"))
    return build(lambda **a: op.paged_attn(**a, causal=causal), params)


def _paged_kernel(legalized: tvm.IRModule) -> tuple[str, tirx.PrimFunc]:
    """The one fuel kernel of a legalized paged module; fails if the floor served the call."""
    kernels = [(gv.name_hint, f) for gv, f in legalized.functions.items()
               if isinstance(f, tirx.PrimFunc) and f.attrs is not None and "fuel.workload" in f.attrs]
    assert len(kernels) == 1 and "paged_attn" in str(kernels[0][1].attrs["fuel.workload"]), kernels
    return kernels[0]


def _kernel_bytes(stmt) -> list[tuple[int, int]]:
    """(static, dynamic) shared bytes of each kernel (outermost blockIdx launch) of a lowered body."""
    kernels: list[list[int]] = []

    def visit(node, inside):
        if (isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent" and not inside
                and str(getattr(node.node, "thread_tag", "")).startswith("blockIdx")):
            kernels.append([0, 0])
            inside = True
        if isinstance(node, tirx.AllocBuffer) and inside and node.buffer.scope() in ("shared", "shared.dyn"):
            size = tvm.DataType(str(node.buffer.dtype)).bits // 8
            for dim in node.buffer.shape:
                size *= int(dim)
            kernels[-1][1 if node.buffer.scope() == "shared.dyn" else 0] += size
        if isinstance(node, tirx.SeqStmt):
            children = list(node.seq)
        else:
            children = [getattr(node, name, None) for name in ("body", "then_case", "else_case")]
        for child in children:
            if isinstance(child, tirx.Stmt):
                visit(child, inside)

    visit(stmt, False)
    return [(static, dynamic) for static, dynamic in kernels]


def launched_bytes(mod: tvm.IRModule, target: tvm.target.Target) -> dict[str, list[tuple[int, int]]]:
    """``{function: [(static, dynamic) per kernel]}`` as the runtime launches them: the shared
    allocations once TVM has merged the dynamic ones into one buffer."""
    seen: dict[str, tirx.PrimFunc] = {}

    @pass_instrument
    class Capture:
        def run_after_pass(self, module, info):
            if info.name.endswith("MergeSharedMemoryAllocations") and not seen:
                seen.update({gv.name_hint: f for gv, f in module.functions.items() if isinstance(f, tirx.PrimFunc)})

    with tvm.transform.PassContext(instruments=[Capture()]):
        tvm.compile(mod, target=target)
    assert seen, "MergeSharedMemoryAllocations did not run: the measurement would be empty"
    return {name: _kernel_bytes(func.body) for name, func in seen.items()}


_MEASURED: dict[tuple, list[tuple[int, int]]] = {}


def _measure(arch, dtype, d, shape, **options) -> tuple[dict, list[tuple[int, int]], tirx.PrimFunc]:
    """(the knobs the rule applied, the paged kernel's launched bytes, its PrimFunc); one build per
    distinct (arch, dtype, head dim, knobs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FloorWarning)  # the floor served the call: no kernel to measure
        legalized = tvm_fuel.transform.legalize(_paged(dtype, d, *shape, **options), _target(arch), kernels="tuned")
    name, func = _paged_kernel(legalized)
    knobs = applied_knobs(func)
    key = (arch, dtype, d, tuple(sorted(knobs.items())))
    if key not in _MEASURED:
        _MEASURED[key] = launched_bytes(legalized, _target(arch))[name]
    return knobs, _MEASURED[key], func


def _problems(arch, dtype, d, shape, knobs, measured) -> list[str]:
    estimate = forward_smem(dtype, d, CudaTiles(**knobs))
    # the attention kernel has shared memory; the split-KV merge kernel (if any) has none
    assert measured and measured[0] != (0, 0) and all(m == (0, 0) for m in measured[1:]), measured
    static, dynamic = measured[0]
    where = f"{arch} {dtype} D{d} (block size, group, Sq)={shape} knobs={knobs}: built {static} + {dynamic}"
    problems = []
    if not launchable(static, dynamic, arch):
        problems.append(f"{where} cannot launch")
    if dynamic != estimate[1] or static > estimate[0]:
        problems.append(f"{where}, estimated {estimate[0]} + {estimate[1]}")
    return problems


DTYPES = ("float16", "bfloat16", "float32")


# every pair of values of any two of head dim x shape x dtype x arch built: 60 builds (the full product
# took 360), each head dim with its 6 shapes (a case per head dim)
_COVERING = pairwise(HEAD_DIMS, ALL, DTYPES, ARCHS)
# the quick run: sm_90 float16 on FEW shapes at the head dims of FEW_DIMS (the smallest, the D 80 decode
# defect, the hand-picked D 128, the largest); the whole suite also the covering array
FEW_DIMS = (40, 80, 128, 256)
CASES = [pytest.param([("sm_90", "float16", d, shape) for d in FEW_DIMS for shape in FEW], id="sm_90-float16-few")] + [
    pytest.param([(arch, dtype, d, shape) for d, shape, dtype, arch in _COVERING if d == head_dim],
                 marks=pytest.mark.slow, id=f"d{head_dim}-pairwise") for head_dim in HEAD_DIMS]


@pytest.mark.parametrize("cases", CASES)
def test_every_paged_block_launches_with_the_estimated_bytes(cases):
    """Every paged kernel the rule builds at head dims 40-256 (``cases``: (arch, dtype, head dim,
    shape)) can be launched by TVM's runtime, with the dynamic bytes the rule estimated and no more
    static bytes (on the old estimate the float16/bfloat16 decode at D 80 failed: 1288 + 47872
    bytes built, 1544 + 68352 estimated)."""
    problems = []
    for arch, dtype, d, shape in cases:
        knobs, measured, _ = _measure(arch, dtype, d, shape)
        _, group, sq = shape
        if group * sq <= 16:  # the decode candidates served the call: one 16-row tile
            assert knobs["block_q"] == 16, (d, shape, knobs)
        problems += _problems(arch, dtype, d, shape, knobs, measured)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", ARCHS)
def test_half_decode_at_d80_declines_the_two_stage_tile(arch):
    """float16 decode at D 80: the two-stage 16 x 64 tile is built with 1288 + 47872 bytes, which
    no launch accepts; the rule's estimate says so (it declines the tile) and the tile it takes
    instead launches. Other head dims keep the two-stage tile (D 128's hand-picked knobs)."""
    target = _target(arch)
    mod = _paged("float16", 80, 16, 4, 1)
    rule = rule_for("paged_attn", target)
    workload = workload_of("paged_attn", mod["main"].body.blocks[0].bindings[0].value)
    assert rule.serves(workload, target)
    old = dict(DECODE_KNOBS, splits=1)
    with pytest.raises(ValueError, match="shared memory"):
        rule.knobs(workload, target, old)
    # the declined tile, built anyway: the measurement agrees that it cannot launch
    unpinned = tvm.IRModule({"main": rule.kernel(workload, old).with_attr("global_symbol", "main")})
    (declined,) = [b for b in launched_bytes(unpinned, target)["main"] if b != (0, 0)]
    estimate = forward_smem("float16", 80, CudaTiles(**old))
    assert declined[1] == estimate[1] and declined[0] <= estimate[0] and not launchable(*declined, arch), declined
    knobs, measured, _ = _measure(arch, "float16", 80, (16, 4, 1))
    assert (knobs["block_q"], knobs["block_k"], knobs["stages"]) == (16, 64, 1), knobs
    assert not _problems(arch, "float16", 80, (16, 4, 1), knobs, measured)
    knobs, _, _ = _measure(arch, "float16", 128, (16, 4, 1))
    assert {name: knobs[name] for name in DECODE_KNOBS} == DECODE_KNOBS, knobs


def test_tuned_d128_decode_keeps_its_record():
    """The H200 bench's paged decode bucket (bfloat16, B64 Hq32 Hkv8 D128, 16-token blocks) still
    takes its tuning record on sm_90 (16-key tiles, 4 splits, one warp), and that block launches
    with the estimated bytes."""
    shape = (16, 4, 1)
    knobs, measured, func = _measure("sm_90", "bfloat16", 128, shape, kv_heads=8, batch=64, num_blocks=16384,
                                     max_blocks=256, causal=False)
    assert str(func.attrs["fuel.match"]) == "exact", dict(func.attrs)
    assert {name: knobs[name] for name in TUNED_D128} == TUNED_D128, knobs
    assert not _problems("sm_90", "bfloat16", 128, shape, knobs, measured)
