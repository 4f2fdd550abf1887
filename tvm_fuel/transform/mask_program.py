"""What a keep mask computed in the graph says, read from the program that computes it.

Exporters write an attention mask as code: index arithmetic on ``arange`` (causal, sliding
window), comparisons, ``and`` of masks, ``tril``/``triu`` of ``full(True)``, views, and gathers of
the user's padding mask (Hugging Face's ``sdpa_mask``, PyTorch's ``is_causal`` decomposition).
``read_keep_mask`` interprets that code over the coordinates of the [B, H, Sq, Sk] score grid, for
static or symbolic lengths, and never evaluates a tensor of Sq * Sk elements: the mask becomes a
band of keys per query row (flash_attn's causal and window options) and what is left (a padding
mask over (batch, key), say) as compact tensors the program already holds.

Two abstract values stand for the tensors read:

* ``_Index``: an integer tensor whose element at coordinates x is ``const + sum(coeffs[d] * x[d])``
  (``arange`` and what views, sums, constant products and gathers make of it);
* ``_Keep``: a bool tensor, the conjunction of linear constraints ``sum(c[d] * x[d]) <= bound`` and
  of opaque bool tensors (``factors``, each broadcast against the value's shape).

An integer tensor computed from constants alone (Hugging Face's packed-sequence ids) is evaluated,
as TVM computes it, when it holds at most ``MAX_EVALUATED`` elements, and read as an ``_Index``
where it is one. A bool tensor the reader cannot interpret is a factor as it stands.

Contents:
    KeepMask          -- the band (lo, hi: key j kept for query i iff i + lo <= j <= i + hi) and factors
    Factor            -- a bool tensor of the graph under a view (what a KeepMask keeps besides its band)
    read_keep_mask    -- the KeepMask of a bool mask expression, given the dataflow bindings it reads
    ConstantEvaluator -- the value of a small tensor computed from constants, as TVM computes it
    constraint_tensor -- a linear constraint on the coordinates as a bool tensor
    broadcast_dims    -- numpy's broadcast of shapes
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from .common import constant_value, int_dim, op_name

MAX_EVALUATED = 1 << 16  # elements of a constant integer tensor evaluated (an O(S) one, never O(S^2))

def _dims(expr: relax.Expr) -> tuple | None:
    shape = expr.ty.shape if isinstance(expr.ty, relax.TensorType) else None
    return tuple(shape.values) if isinstance(shape, relax.ShapeExpr) else None


def _same_dim(a, b) -> bool:
    return tvm.sym.Analyzer().can_prove_equal(a, b) if not isinstance(a, int) or not isinstance(b, int) else a == b


def _is_one(dim) -> bool:
    return int_dim(dim) == 1


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    """numpy's broadcast of two shapes (right aligned), None where they clash."""
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + tuple(a), (1,) * (rank - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if _is_one(x):
            out.append(y)
        elif _is_one(y) or _same_dim(x, y):
            out.append(x)
        else:
            return None
    return tuple(out)


def _pad(coeffs: tuple[int, ...], rank: int) -> tuple[int, ...]:
    return (0,) * (rank - len(coeffs)) + tuple(coeffs)


def _unit_free(coeffs: tuple[int, ...], shape: tuple) -> tuple[int, ...]:
    """Coefficients with those of size-1 axes zeroed (their coordinate is always 0)."""
    return tuple(0 if _is_one(n) else c for c, n in zip(coeffs, shape))


@dataclass(frozen=True)
class _Index:
    shape: tuple
    const: int
    coeffs: tuple[int, ...]

    def aligned(self, rank: int) -> _Index:
        return _Index((1,) * (rank - len(self.shape)) + self.shape, self.const, _pad(self.coeffs, rank))


@dataclass(frozen=True)
class Factor:
    """A bool tensor of the graph, ``base``, viewed with ``dims`` (its elements in their order,
    size-1 dims moved in or out; broadcast against the mask): ``tensor()`` is the view."""

    base: relax.Expr
    dims: tuple

    def tensor(self) -> relax.Expr:
        base_dims = _dims(self.base)
        same = base_dims is not None and len(base_dims) == len(self.dims) and all(
            _same_dim(a, b) for a, b in zip(base_dims, self.dims))
        return self.base if same else relax.op.reshape(self.base, list(self.dims))

    def aligned(self, rank: int) -> Factor:
        return Factor(self.base, (1,) * (rank - len(self.dims)) + tuple(self.dims))

    def moved(self, axes: list, rank: int) -> Factor | None:
        """The factor under a view moving old axis a to ``axes[a]`` (None: dropped, size 1 only);
        None where the view reorders its non-unit dims (no reshape says that)."""
        dims, targets = [1] * rank, []
        for axis, target in enumerate(axes):
            if target is None:
                if not _is_one(self.dims[axis]):
                    return None
            elif not _is_one(self.dims[axis]):
                dims[target] = self.dims[axis]
                targets.append(target)
        return Factor(self.base, tuple(dims)) if targets == sorted(targets) else None


@dataclass(frozen=True)
class _Keep:
    shape: tuple
    constraints: frozenset = frozenset()
    factors: tuple = ()  # Factors of the value's rank, broadcast against ``shape``

    def aligned(self, rank: int) -> _Keep:
        pad = rank - len(self.shape)
        if pad == 0:
            return self
        return _Keep((1,) * pad + self.shape, frozenset((_pad(c, rank), b) for c, b in self.constraints),
                     tuple(f.aligned(rank) for f in self.factors))


@dataclass(frozen=True)
class KeepMask:
    """A keep mask read from its program: key j is kept for query i iff ``i + lo <= j <= i + hi``
    (None: unbounded on that side) and every one of ``factors`` (``Factor``s of bool tensors the
    graph computes, of rank ``rank``, broadcast against the mask's [.., Sq, Sk]) holds;
    ``constraints`` are the linear constraints that are no band (on the batch or head axis, or on
    one of i, j alone)."""

    rank: int
    lo: int | None = None
    hi: int | None = None
    factors: tuple = ()
    constraints: tuple = ()


class _Reader:
    """The interpreter: ``read(expr)`` is an ``_Index``, a ``_Keep`` or None (not understood)."""

    def __init__(self, bindings: dict, evaluate: Callable[[relax.Expr], np.ndarray | None]):
        self.bindings, self.evaluate = bindings, evaluate
        self.memo: dict = {}

    def read(self, expr: relax.Expr):
        if isinstance(expr, relax.Var):
            if expr not in self.memo:
                value = self.bindings.get(expr)
                self.memo[expr] = None if value is None else self._read_value(value, expr)
            return self.memo[expr]
        return self._read_value(expr, expr)

    def keep(self, expr: relax.Expr) -> _Keep | None:
        """``expr`` (a bool tensor) as a ``_Keep``: read, or a factor as it stands."""
        value = self.read(expr)
        if isinstance(value, _Keep):
            return value
        shape = _dims(expr)
        if shape is None or str(expr.ty.dtype) != "bool":
            return None
        return _Keep(shape, factors=(Factor(expr, shape),))

    def _read_value(self, value: relax.Expr, named: relax.Expr):
        shape = _dims(named)
        if shape is None:
            return None
        dtype = str(named.ty.dtype)
        array = constant_value(value)
        if array is not None:
            return self._constant(array, shape, dtype)
        if not isinstance(value, relax.Call):
            return None
        read = _READERS.get(op_name(value))
        result = read(self, value, shape) if read is not None else None
        if result is None and dtype.startswith(("int", "uint")):
            result = self._evaluated(named, shape)
        return result

    def _constant(self, array: np.ndarray, shape: tuple, dtype: str):
        if dtype == "bool":
            return _Keep(shape) if array.all() else None
        if dtype.startswith(("int", "uint")):
            return _fit_index(array, shape)
        return None

    def _evaluated(self, expr: relax.Expr, shape: tuple):
        sizes = [int_dim(n) for n in shape]
        if None in sizes or math.prod(sizes) > MAX_EVALUATED:
            return None
        array = self.evaluate(expr)
        return None if array is None else _fit_index(np.asarray(array).reshape(sizes), shape)

    def index(self, expr) -> _Index | None:
        value = self.read(expr)
        return value if isinstance(value, _Index) else None


def _fit_index(array: np.ndarray, shape: tuple) -> _Index | None:
    """``array`` as an ``_Index`` (const + sum(coeffs * x)) where it is exactly one."""
    if array.size == 0:
        return None
    array = array.astype(np.int64)
    const = int(array.flat[0])
    coeffs = []
    for axis, n in enumerate(array.shape):
        coeffs.append(int(np.take(array, 1, axis=axis).flat[0]) - const if n > 1 else 0)
    grids = np.indices(array.shape, dtype=np.int64)  # one coordinate grid per axis (none for a scalar)
    expected = const + sum((c * g for c, g in zip(coeffs, grids)), np.zeros(array.shape, np.int64))
    if not np.array_equal(array, expected):
        return None
    return _Index(shape, const, tuple(coeffs))


# ---- the ops read ------------------------------------------------------------------------------


def _arange(reader: _Reader, call: relax.Call, shape: tuple):
    start, _, step = (int_dim(a) for a in call.args)  # IntImm arguments in TVM 0.27's Relax
    return None if start is None or step is None else _Index(shape, start, (step,))


def _combined(reader: _Reader, call: relax.Call, shape: tuple, sign: int) -> _Index | None:
    """``a + sign * b`` of the call's two index operands (broadcast to ``shape``)."""
    a, b = (reader.index(x) for x in call.args)
    if a is None or b is None:
        return None
    a, b = a.aligned(len(shape)), b.aligned(len(shape))
    coeffs = tuple(x + sign * y for x, y in zip(a.coeffs, b.coeffs))
    return _Index(shape, a.const + sign * b.const, _unit_free(coeffs, shape))


def _arith(sign: int) -> Callable:
    return lambda reader, call, shape: _combined(reader, call, shape, sign)


def _multiply(reader: _Reader, call: relax.Call, shape: tuple):
    a, b = (reader.index(x) for x in call.args)
    if a is None or b is None:
        return None
    if any(b.coeffs):
        a, b = b, a
    if any(b.coeffs):
        return None  # a product of two varying indices is no longer affine
    a = a.aligned(len(shape))
    return _Index(shape, a.const * b.const, tuple(c * b.const for c in a.coeffs))


def _view(transform: Callable) -> Callable:
    """A view op read on either value: ``transform(call, old dims, new dims)`` maps each old axis
    to its new axis (None there: dropped, size 1 only), or is None where the op is no view the
    reader follows."""
    def read(reader: _Reader, call: relax.Call, shape: tuple):
        source = reader.read(call.args[0])
        old = _dims(call.args[0])
        if source is None or old is None:
            return None
        axes = transform(call, old, shape)
        if axes is None:
            return None

        def moved(coeffs):
            out = [0] * len(shape)
            for axis, c in enumerate(coeffs):
                if c:
                    if axes[axis] is None:
                        return None
                    out[axes[axis]] = c
            return _unit_free(tuple(out), shape)

        if isinstance(source, _Index):
            coeffs = moved(source.coeffs)
            return None if coeffs is None else _Index(shape, source.const, coeffs)
        constraints = [(moved(c), b) for c, b in source.constraints]
        if any(c is None for c, _ in constraints):
            return None
        factors = tuple(_view_factor(call, f, old, shape, axes) for f in source.factors)
        return None if None in factors else _Keep(shape, frozenset(constraints), factors)
    return read


def _view_factor(call: relax.Call, factor: Factor, old: tuple, new: tuple, axes: list) -> Factor | None:
    """The factor (of the old rank) under the view: broadcasts stay implicit, axes move."""
    if op_name(call) == "relax.broadcast_to":
        return factor.aligned(len(new))
    return factor.moved(axes, len(new))


def _expand_axes(call: relax.Call, old: tuple, new: tuple) -> list | None:
    inserted = sorted(int(a) % len(new) for a in call.attrs.axis)
    kept = [axis for axis in range(len(new)) if axis not in inserted]
    return kept if len(kept) == len(old) else None


def _broadcast_axes(call: relax.Call, old: tuple, new: tuple) -> list | None:
    pad = len(new) - len(old)
    return list(range(pad, len(new))) if pad >= 0 else None


def _reshape_axes(call: relax.Call, old: tuple, new: tuple) -> list | None:
    """Old axis -> new axis where the reshape only inserts or drops size-1 dims."""
    big_old = [a for a, n in enumerate(old) if not _is_one(n)]
    big_new = [a for a, n in enumerate(new) if not _is_one(n)]
    if len(big_old) != len(big_new) or not all(_same_dim(old[a], new[b]) for a, b in zip(big_old, big_new)):
        return None
    axes: list = [None] * len(old)
    for a, b in zip(big_old, big_new):
        axes[a] = b
    return axes


def _permute_axes(call: relax.Call, old: tuple, new: tuple) -> list | None:
    order = list(range(len(old)))[::-1] if call.attrs.axes is None else [int(a) % len(old) for a in call.attrs.axes]
    axes: list = [None] * len(old)
    for target, source in enumerate(order):
        axes[source] = target
    return axes


def _astype(reader: _Reader, call: relax.Call, shape: tuple):
    source = reader.read(call.args[0])
    target = str(call.attrs.dtype)
    if isinstance(source, _Index) and target.startswith(("int", "uint")):
        return source  # index values stay far inside every integer type the exporters use
    if isinstance(source, _Keep) and target == "bool":
        return source
    return None


def _gather(reader: _Reader, call: relax.Call, shape: tuple):
    """``index_tensor(x, (i0, i1, ...))``: x's affine form composed with the indices'."""
    source = reader.index(call.args[0])
    indices = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else None
    if source is None or indices is None or len(indices) > len(source.shape):
        return None
    read = [reader.index(i) for i in indices]
    if None in read:
        return None
    rank = len(shape)
    lead = rank - (len(source.shape) - len(indices))  # the indices' broadcast rank, then x's other axes
    const, coeffs = source.const, [0] * rank
    for axis, index in enumerate(read):
        index = index.aligned(lead)
        const += source.coeffs[axis] * index.const
        for d, c in enumerate(index.coeffs):
            coeffs[d] += source.coeffs[axis] * c
    for axis in range(len(indices), len(source.shape)):
        coeffs[lead + axis - len(indices)] += source.coeffs[axis]
    return _Index(shape, const, _unit_free(tuple(coeffs), shape))


def _compare(kind: str) -> Callable:
    def read(reader: _Reader, call: relax.Call, shape: tuple):
        difference = _combined(reader, call, shape, -1)  # a - b = diff . x + const
        if difference is None:
            return None
        diff, const = difference.coeffs, difference.const
        neg = tuple(-c for c in diff)
        constraints = {"less_equal": [(diff, -const)], "less": [(diff, -const - 1)],
                       "greater_equal": [(neg, const)], "greater": [(neg, const - 1)],
                       "equal": [(diff, -const), (neg, const)]}[kind]
        return _Keep(shape, frozenset((c, bound) for c, bound in constraints))
    return read


def _and(reader: _Reader, call: relax.Call, shape: tuple):
    parts = [reader.keep(x) for x in call.args]
    if None in parts or str(call.args[0].ty.dtype) != "bool" or str(call.args[1].ty.dtype) != "bool":
        return None
    rank = len(shape)
    a, b = (p.aligned(rank) for p in parts)
    return _Keep(shape, a.constraints | b.constraints, a.factors + b.factors)


def _not(reader: _Reader, call: relax.Call, shape: tuple):
    source = reader.read(call.args[0])
    if not isinstance(source, _Keep) or source.factors or len(source.constraints) != 1:
        return None
    ((coeffs, bound),) = source.constraints
    return _Keep(shape, frozenset({(tuple(-c for c in coeffs), -bound - 1)}))  # not(c.x <= b): -c.x <= -b - 1


def _full(reader: _Reader, call: relax.Call, shape: tuple):
    fill = constant_value(call.args[1])
    if fill is None or fill.size != 1:
        return None
    if str(call.attrs.dtype) == "bool":
        return _Keep(shape) if fill.all() else None
    if str(call.attrs.dtype).startswith(("int", "uint")):
        return _Index(shape, int(fill.reshape(())), (0,) * len(shape))
    return None


def _ones(reader: _Reader, call: relax.Call, shape: tuple):
    return _Keep(shape) if str(call.attrs.dtype) == "bool" else None


def _band(upper: bool) -> Callable:
    def read(reader: _Reader, call: relax.Call, shape: tuple):
        source = reader.keep(call.args[0])
        k = int_dim(call.args[1])
        if source is None or k is None or len(shape) < 2:
            return None
        coeffs = [0] * len(shape)
        # tril keeps j - i <= k; triu keeps j - i >= k, i.e. i - j <= -k
        coeffs[-1], coeffs[-2] = (1, -1) if not upper else (-1, 1)
        constraint = (_unit_free(tuple(coeffs), shape), k if not upper else -k)
        return _Keep(shape, source.constraints | {constraint}, source.factors)
    return read


_READERS: dict[str, Callable] = {
    "relax.arange": _arange,
    "relax.add": _arith(1),
    "relax.subtract": _arith(-1),
    "relax.multiply": _multiply,
    "relax.expand_dims": _view(_expand_axes),
    "relax.broadcast_to": _view(_broadcast_axes),
    "relax.reshape": _view(_reshape_axes),
    "relax.squeeze": _view(_reshape_axes),  # dropping size-1 dims: a reshape's view
    "relax.permute_dims": _view(_permute_axes),
    "relax.astype": _astype,
    "relax.index_tensor": _gather,
    "relax.less_equal": _compare("less_equal"),
    "relax.less": _compare("less"),
    "relax.greater_equal": _compare("greater_equal"),
    "relax.greater": _compare("greater"),
    "relax.equal": _compare("equal"),
    "relax.logical_and": _and,
    "relax.bitwise_and": _and,
    "relax.logical_not": _not,
    "relax.bitwise_not": _not,
    "relax.full": _full,
    "relax.ones": _ones,
    "relax.tril": _band(upper=False),
    "relax.triu": _band(upper=True),
}


def read_keep_mask(mask: relax.Expr, bindings: dict,
                   evaluate: Callable[[relax.Expr], np.ndarray | None] | None = None) -> KeepMask | None:
    """The KeepMask of the bool ``mask`` (broadcast against [.., Sq, Sk]: its last two axes are the
    query and the key), reading the dataflow ``bindings`` (var -> value) its program runs through;
    ``evaluate`` gives the value of a small integer tensor computed from constants, or None
    (default: a ``ConstantEvaluator`` of ``bindings``). None where the mask is no bool tensor of
    known shape."""
    keep = _Reader(bindings, evaluate or ConstantEvaluator(bindings)).keep(mask)
    if keep is None or len(keep.shape) < 2:
        return None
    lo = hi = None
    others = []
    for coeffs, bound in keep.constraints:
        lead, (ci, cj) = coeffs[:-2], coeffs[-2:]
        if any(lead) or (ci, cj) not in ((-1, 1), (1, -1)):
            if not any(coeffs):
                if bound >= 0:
                    continue  # always true
            others.append((coeffs, bound))
        elif cj == 1:  # j - i <= bound
            hi = bound if hi is None else min(hi, bound)
        else:  # i - j <= bound: j >= i - bound
            lo = -bound if lo is None else max(lo, -bound)
    return KeepMask(len(keep.shape), lo, hi, keep.factors, tuple(others))


def constraint_tensor(coeffs: tuple[int, ...], bound: int, shape: tuple) -> relax.Expr:
    """A bool tensor of ``shape`` (size 1 where the coefficient is 0) holding ``sum(c * x) <= bound``."""
    total = None
    for axis, (c, n) in enumerate(zip(coeffs, shape)):
        if not c:
            continue
        dims = [1] * len(shape)
        dims[axis] = n
        term = relax.op.reshape(relax.op.multiply(relax.op.arange(0, n, 1, "int64"), relax.const(c, "int64")),
                                dims)
        total = term if total is None else relax.op.add(total, term)
    if total is None:
        return relax.op.full([1] * len(shape), relax.const(bound >= 0, "bool"), "bool")
    return relax.op.less_equal(total, relax.const(bound, "int64"))


class ConstantEvaluator:
    """The value of a tensor computed from constants alone, as TVM computes it: the ``bindings``
    it reads copied into a function of no parameters, legalized and folded
    (``relax.transform.FoldConstant``), else (an op FoldConstant leaves, such as ``cumsum``) built
    for and run on the CPU. None where it reads anything else or holds more than ``MAX_EVALUATED``
    elements. ``memo`` (structural hash -> [(function, value)]) may be shared between functions."""

    def __init__(self, bindings: dict, memo: dict | None = None):
        self.bindings, self.memo = bindings, {} if memo is None else memo

    def __call__(self, expr: relax.Expr) -> np.ndarray | None:
        dims = _dims(expr)
        sizes = None if dims is None else [int_dim(n) for n in dims]
        if sizes is None or None in sizes or math.prod(sizes) > MAX_EVALUATED:
            return None
        needed, todo = set(), list(relax.analysis.free_vars(expr))
        while todo:
            var = todo.pop()
            if var not in self.bindings:
                return None
            if var not in needed:
                needed.add(var)
                todo.extend(relax.analysis.free_vars(self.bindings[var]))
        out = relax.Var("value", expr.ty)
        bindings = [relax.VarBinding(var, value) for var, value in self.bindings.items() if var in needed]
        func = relax.Function([], relax.SeqExpr([relax.DataflowBlock([*bindings, relax.VarBinding(out, expr)])], out),
                              expr.ty)
        known = self.memo.setdefault(tvm_ffi.structural_hash(func), [])
        for other, value in known:
            if tvm_ffi.structural_equal(other, func):
                return value
        folded = relax.transform.FoldConstant()(relax.transform.LegalizeOps()(tvm.IRModule({"main": func})))
        value = constant_value(folded["main"].body.body)
        if value is None:
            value = _run(folded)
        known.append((func, value))
        return value


def _run(mod: tvm.IRModule) -> np.ndarray | None:
    """The value the parameterless ``main`` of ``mod`` returns, built for and run on the CPU."""
    try:
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        return vm["main"]().numpy()
    except tvm.error.TVMError:
        return None  # not buildable as it stands: the mask is read without this value


def broadcast_dims(shapes: list[tuple]) -> tuple | None:
    """The broadcast of ``shapes`` (right aligned), None where two clash."""
    out: tuple | None = ()
    for shape in shapes:
        out = None if out is None else _broadcast(out, tuple(shape))
    return out


__all__ = ["KeepMask", "Factor", "read_keep_mask", "ConstantEvaluator", "constraint_tensor", "broadcast_dims",
           "MAX_EVALUATED"]
