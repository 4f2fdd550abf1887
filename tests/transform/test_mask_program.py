"""The mask reader (``tvm_fuel.transform.mask_program``) against TVM evaluating the same mask.

Each case is a keep-mask program as exporters write them (index arithmetic on ``arange``,
comparisons, ``and``, ``not``, ``tril`` of ``full(True)``, gathers of a padding mask, Hugging Face's
packed-sequence ids). The test reads it into a band and factors, materializes that reading in
numpy, and compares it with the mask TVM computes from the program (built and run on the CPU), for
random padding. The band a case expects is checked too, so a reading that gives up (the whole mask
as one factor) cannot pass for a case that should be a band.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_fuel.transform.mask_program import MAX_EVALUATED, read_keep_mask

pytestmark = pytest.mark.numerics

B = 2
op = relax.op


def _index(bb, n, *, at: int, rank: int, offset: int = 0):
    """arange(n) + offset, with size-1 dims around it so that it lies along axis ``at`` of ``rank``."""
    x = bb.emit(op.add(op.arange(0, n, 1, "int64"), relax.const(offset, "int64")))
    dims = [1] * rank
    dims[at] = n
    return bb.emit(op.reshape(x, dims))


def _causal(bb, sq, sk, pad, *, offset=0):
    i, j = _index(bb, sq, at=2, rank=4, offset=offset), _index(bb, sk, at=3, rank=4)
    return bb.emit(op.less_equal(j, i))


def _window(bb, sq, sk, pad):
    i, j = _index(bb, sq, at=2, rank=4), _index(bb, sk, at=3, rank=4)
    recent = bb.emit(op.greater(j, bb.emit(op.subtract(i, relax.const(16, "int64")))))
    return bb.emit(op.bitwise_and(recent, bb.emit(op.less_equal(j, i))))


def _tril(bb, sq, sk, pad, *, k=0):
    return bb.emit(op.tril(bb.emit(op.full([sq, sk], relax.const(True, "bool"), "bool")), k))


def _triu(bb, sq, sk, pad):
    return bb.emit(op.triu(bb.emit(op.full([sq, sk], relax.const(True, "bool"), "bool")), 1))


def _not_after(bb, sq, sk, pad):
    """not(j > i): the causal mask written as the negation of the future."""
    i, j = _index(bb, sq, at=0, rank=2), _index(bb, sk, at=1, rank=2)
    return bb.emit(op.logical_not(bb.emit(op.greater(j, i))))


def _padded_causal(bb, sq, sk, pad):
    """Hugging Face's sdpa_mask with an attention mask: causal and pad[b, j], gathered by index."""
    b_index = bb.emit(op.reshape(op.arange(0, B, 1, "int64"), [B, 1, 1, 1]))
    j = _index(bb, sk, at=3, rank=4)
    keep_pad = bb.emit(op.index_tensor(bb.emit(op.astype(pad, "bool")), relax.Tuple([b_index, j])))
    return bb.emit(op.broadcast_to(bb.emit(op.bitwise_and(_causal(bb, sq, sk, pad), keep_pad)), [B, 1, sq, sk]))


def _packed_ids(bb, sq, sk, pad):
    """transformers 5 from ids alone: causal over position ids, and equal packed-sequence ids,
    (position_diff != 1).cumsum(-1) (all 0 for one sequence), evaluated as an O(S) tensor."""
    positions = bb.emit(op.reshape(op.arange(0, sk, 1, "int64"), [1, sk]))
    first = bb.emit(op.subtract(bb.emit(op.strided_slice(positions, [1], [0], [1])), relax.const(1, "int64")))
    shifted = bb.emit(op.concat([first, positions], axis=-1))
    diff = bb.emit(op.subtract(bb.emit(op.strided_slice(shifted, [1], [1], [sk + 1])),
                               bb.emit(op.strided_slice(shifted, [1], [0], [sk]))))
    ids = bb.emit(op.cumsum(bb.emit(op.astype(bb.emit(op.not_equal(diff, relax.const(1, "int64"))), "int64")),
                            axis=-1, dtype="int64"))
    zero = bb.emit(op.reshape(op.arange(0, 1, 1, "int64"), [1, 1, 1, 1]))
    i, j = _index(bb, sq, at=2, rank=4), _index(bb, sk, at=3, rank=4)
    same = bb.emit(op.equal(bb.emit(op.index_tensor(ids, relax.Tuple([zero, i]))),
                            bb.emit(op.index_tensor(ids, relax.Tuple([zero, j])))))
    return bb.emit(op.bitwise_and(_causal(bb, sq, sk, pad), same))


def _or(bb, sq, sk, pad):
    """causal or the first key (an attention sink): no conjunction, one factor as it stands."""
    i, j = _index(bb, sq, at=0, rank=2), _index(bb, sk, at=1, rank=2)
    first = bb.emit(op.equal(j, relax.const(0, "int64")))
    return bb.emit(op.logical_or(bb.emit(op.less_equal(j, i)), first))


def _key_range(bb, sq, sk, pad):
    """keys 3 <= j (no query in it): a constraint on the key alone, a compact [1, Sk] tensor."""
    j = _index(bb, sk, at=1, rank=2)
    return bb.emit(op.bitwise_and(_tril(bb, sq, sk, pad), bb.emit(op.greater_equal(j, relax.const(3, "int64")))))


class Case(NamedTuple):
    build: Callable
    sq: int
    sk: int
    band: tuple  # (lo, hi) the reading must find
    factors: int  # how many factors it keeps
    constraints: int = 0  # constraints that are no band


CASES = {
    "causal": Case(_causal, 17, 17, (None, 0), 0),
    # one query or one key: the size-1 axis reads as coordinate 0, the rest is a constraint on the other axis
    "causal_one_query": Case(_causal, 1, 17, (None, None), 0, 1),
    "causal_one_key": Case(_causal, 17, 1, (None, None), 0, 1),
    "causal_bottom_right": Case(lambda bb, sq, sk, pad: _causal(bb, sq, sk, pad, offset=8), 5, 13, (None, 8), 0),
    "sliding_window": Case(_window, 97, 97, (-15, 0), 0),
    "tril_97": Case(_tril, 97, 97, (None, 0), 0),  # past FoldConstant's 1024 elements, read all the same
    "tril_above": Case(lambda bb, sq, sk, pad: _tril(bb, sq, sk, pad, k=2), 7, 9, (None, 2), 0),
    "triu": Case(_triu, 9, 9, (1, None), 0),
    "not_after": Case(_not_after, 17, 40, (None, 0), 0),
    "padded_causal": Case(_padded_causal, 17, 17, (None, 0), 1),
    "packed_ids": Case(_packed_ids, 40, 40, (None, 0), 0),
    "or_sink": Case(_or, 17, 17, (None, None), 1),
    "key_range": Case(_key_range, 9, 9, (None, 0), 0, 1),
}


def _program(case: Case) -> tuple[relax.Function, relax.Expr]:
    bb = relax.BlockBuilder()
    pad = relax.Var("pad", relax.TensorType([B, case.sk], "int64"))
    with bb.function("main", [pad]):
        mask = case.build(bb, case.sq, case.sk, pad)
        bb.emit_func_output(mask)
    func = bb.get()["main"]
    return func, mask


def _run(func: relax.Function, outputs: list) -> list[np.ndarray]:
    """What TVM computes for ``outputs`` (vars of ``func``'s bindings), given ``func``'s inputs."""
    body = relax.SeqExpr(func.body.blocks, relax.Tuple(outputs))
    mod = tvm.IRModule({"main": relax.Function(func.params, body, relax.TupleType([o.ty for o in outputs]))})
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"]


def _reading(keep, sq: int, sk: int, factors: list[np.ndarray]) -> np.ndarray:
    """The reading materialized: the band, each factor (its graph tensor under its view), the rest."""
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    out = np.ones((sq, sk), bool)
    if keep.lo is not None:
        out &= j >= i + keep.lo
    if keep.hi is not None:
        out &= j <= i + keep.hi
    out = out.reshape((1,) * (keep.rank - 2) + (sq, sk))
    for factor, value in zip(keep.factors, factors):
        out = out & value.reshape([int(d) for d in factor.dims])
    for coeffs, bound in keep.constraints:
        grids = np.indices([sq if c and axis == keep.rank - 2 else sk if c else 1
                            for axis, c in enumerate(coeffs)])
        out = out & (sum(c * g for c, g in zip(coeffs, grids)) <= bound)
    return out


@pytest.mark.parametrize("name", CASES)
def test_reading_is_the_mask_tvm_computes(name):
    case = CASES[name]
    func, mask = _program(case)
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    keep = read_keep_mask(mask, bindings)
    assert (keep.lo, keep.hi) == case.band
    assert (len(keep.factors), len(keep.constraints)) == (case.factors, case.constraints)
    run = _run(func, [mask] + [f.base for f in keep.factors])
    rng = np.random.default_rng(0)
    for _ in range(3):
        pad = (rng.random((B, case.sk)) > 0.3).astype("int64")
        pad[:, -1] = 1
        values = run(tvm.runtime.tensor(pad))
        expected, factors = values[0].numpy(), [v.numpy() for v in list(values)[1:]]
        got = np.broadcast_to(_reading(keep, case.sq, case.sk, factors), expected.shape)
        np.testing.assert_array_equal(got, expected)


def test_symbolic_lengths_read_as_a_band():
    """arange over a symbolic length: the band comes from the program, no value is evaluated."""
    s = tvm.tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([s], "float32"))
    with bb.function("main", [x]):
        i = bb.emit(op.expand_dims(op.arange(0, s, 1, "int64"), [1]))
        j = bb.emit(op.expand_dims(op.arange(0, s, 1, "int64"), [0]))
        window = bb.emit(op.greater_equal(j, bb.emit(op.subtract(i, relax.const(4, "int64")))))
        mask = bb.emit(op.logical_and(bb.emit(op.less_equal(j, i)), window))
        bb.emit_func_output(mask)
    func = bb.get()["main"]
    keep = read_keep_mask(mask, {b.var: b.value for block in func.body.blocks for b in block.bindings},
                          evaluate=lambda expr: pytest.fail("nothing should be evaluated"))
    assert (keep.lo, keep.hi, keep.factors, keep.constraints) == (-4, 0, (), ())


def test_a_mask_of_another_dtype_or_unknown_shape_is_not_read():
    x = relax.Var("x", relax.TensorType([3, 3], "float32"))
    assert read_keep_mask(x, {}) is None
    y = relax.Var("y", relax.TensorType(None, "bool", ndim=2))
    assert read_keep_mask(y, {}) is None


def test_constant_tensors_past_the_limit_are_not_evaluated():
    """An integer tensor of more than MAX_EVALUATED elements is never evaluated: its comparison is
    a factor as it stands."""
    n = int(np.sqrt(MAX_EVALUATED)) + 1
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1], "float32"))
    with bb.function("main", [x]):
        grid = bb.emit(op.cumsum(bb.emit(op.ones([n, n], "int64")), axis=1, dtype="int64"))
        mask = bb.emit(op.less_equal(grid, relax.const(3, "int64")))
        bb.emit_func_output(mask)
    func = bb.get()["main"]
    keep = read_keep_mask(mask, {b.var: b.value for block in func.body.blocks for b in block.bindings},
                          evaluate=lambda expr: pytest.fail("an O(S^2) tensor was evaluated"))
    assert len(keep.factors) == 1 and keep.factors[0].base.same_as(mask)
