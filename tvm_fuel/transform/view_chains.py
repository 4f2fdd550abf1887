"""Chains of views and scales between the ops of an attention pattern (``relax.dpl``), as the
exporters write them: a pattern's operand under reshapes and broadcasts, and products or quotients
by scalar constants (the softmax scale spread over q, k and the scores), read back by ``peel``.

Contents:
    any_of      -- the alternation of patterns
    scalar      -- the value of a scalar float constant (or a ``full`` of one)
    Chain       -- a leaf pattern under views and scales, and what they hold
    KV          -- k or v under a chain, GQA's head repeat (and multi-query's broadcast) undone
    head_repeat -- H of a broadcast of one head to H
    numel       -- the element count of a static shape
"""

from __future__ import annotations

import functools
import math
import operator

from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from ..op.nn_attention import static_dims
from .common import constant_value, op_name


def any_of(*patterns: DFPattern) -> DFPattern:
    """Any of ``patterns``."""
    return functools.reduce(operator.or_, patterns)


def scalar(expr) -> float | None:
    """The value of a scalar float constant or of a ``full`` of one (None if ``expr`` is neither)."""
    if op_name(expr) == "relax.full":
        expr = expr.args[1]
    value = constant_value(expr)
    return float(value.reshape(())) if value is not None and value.size == 1 and value.dtype.kind == "f" else None


VIEWS = ("relax.reshape", "relax.broadcast_to")
DEPTH = 6  # views and scales followed between two ops of the pattern (the importers write up to 3)


class Chain:
    """``leaf`` under up to ``DEPTH`` views (reshape, broadcast_to) and, where ``scaled``, products
    and quotients by a constant; matched greedily (the leaf is none of these ops)."""

    def __init__(self, leaf: DFPattern, scaled: bool):
        def step(x: DFPattern, const: DFPattern) -> DFPattern:
            scales = [is_op("relax.multiply")(x, const), is_op("relax.divide")(x, const)] if scaled else []
            return any_of(*(is_op(name)(x, wildcard()) for name in VIEWS), *scales)

        self.leaf, self.steps = leaf, []  # steps: (pattern, its constant), bottom up
        bottom = leaf & ~step(wildcard(), is_const())
        self.pattern = bottom
        for _ in range(DEPTH):
            const = is_const()
            self.steps.append((step(self.pattern, const), const))
            self.pattern = self.steps[-1][0] | bottom

    def matched(self, m) -> list[tuple]:
        """(constant pattern, expression) of each step matched, top down."""
        return [(const, m[step]) for step, const in reversed(self.steps) if step in m]

    def peel(self, m, heads: list | None = None) -> tuple[relax.Expr, list[float], bool]:
        """(where the peeling stops, the scale factors above it, whether that is the leaf): it stops
        at a view that changes the element count and at a product or quotient by anything but a
        float scalar (a nonzero one for a quotient). Given ``heads``, one broadcast of a single
        head to H heads (multi-query k and v) is passed, H appended to it."""
        scales: list[float] = []
        for const, value in self.matched(m):
            name = op_name(value)
            if name in VIEWS:
                if numel(value.args[0]) != numel(value):
                    repeat = head_repeat(value) if heads == [] else None
                    if repeat is None:
                        return value, scales, False
                    heads.append(repeat)
                continue
            factor = scalar(m[const])
            if factor is None or name == "relax.divide" and not factor:
                return value, scales, False
            scales.append(factor if name == "relax.multiply" else 1.0 / factor)
        return m[self.leaf], scales, True


class KV:
    """k or v under a chain, GQA's head repeat undone: ``expand_dims(x, 2)`` broadcast to
    [B, Hkv, group, S, D] (and merged), so head h reads x's head h // group."""

    def __init__(self, scaled: bool):
        self.inner = Chain(wildcard(), scaled)
        self.expand = is_op("relax.expand_dims")(self.inner.pattern)
        self.chain = Chain(self.expand | wildcard(), scaled)
        self.pattern = self.chain.pattern

    def peel(self, m) -> tuple[relax.Expr, int, list[float]]:
        """(k or v, its group, the scale factors)."""
        heads: list = []
        x, scales, whole = self.chain.peel(m, heads)
        if heads:  # one head broadcast to every query head (multi-query)
            return (x, heads[0], scales) if whole else (x, 1, scales)
        steps = self.chain.matched(m)
        repeat = steps[-1][1] if steps and self.expand in m else None  # the step right above expand_dims
        if op_name(repeat) == "relax.broadcast_to" and (whole or x.same_as(repeat)):
            expand = m[self.expand]
            src, out = static_dims(expand.args[0]), static_dims(repeat)
            if ([int(a) % 5 for a in expand.attrs.axis] == [2] and len(src) == 4 and None not in src + out
                    and out == [src[0], src[1], out[2], src[2], src[3]]):
                x, more, _ = self.inner.peel(m)
                return x, out[2], scales + more
        return x, 1, scales


def head_repeat(call) -> int | None:
    """H of a ``broadcast_to`` from [B, 1, m, n] to [B, H, m, n] (one head repeated), else None."""
    if op_name(call) != "relax.broadcast_to":
        return None
    src, out = static_dims(call.args[0]), static_dims(call)
    if len(src) != 4 or None in src + out or src[1] != 1 or out[:1] + out[2:] != src[:1] + src[2:]:
        return None
    return out[1]


def numel(expr) -> int | None:
    dims = static_dims(expr)
    return None if None in dims else math.prod(dims)



__all__ = ["any_of", "scalar", "Chain", "KV", "head_repeat", "numel", "VIEWS"]
