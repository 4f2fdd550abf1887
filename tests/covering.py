"""Pairwise covering arrays for test parameters: every pair of values of any two parameters is
tried by some test, in far fewer tests than the full product.

A bug that needs one option is found by a test holding it; one that needs two options together
(causal with a window, a mask with GQA) by a test holding that pair. The full product of five
options with three values each is 243 tests; a pairwise array of it, 15. The array is built
greedily and deterministically (the same tests on every run and every xdist worker).

Contents:
    pairwise -- the parameter tuples of a pairwise covering array, for ``pytest.mark.parametrize``
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence


def pairwise(*axes: Sequence[Any], valid: Callable[..., bool] | None = None,
             include: Sequence[tuple] = ()) -> list[tuple]:
    """Tuples (one value per axis) such that each pair of values of any two axes that some valid
    tuple of the product holds appears in at least one tuple (``valid(*values)``: whether a tuple
    of the product is a case at all; default: every one is). ``include``: tuples of the product
    taken first (cases another test needs), the array completed around them. With fewer than two
    axes: the valid tuples of the product."""
    rows = [row for row in itertools.product(*axes) if valid is None or valid(*row)]
    missing = [row for row in include if tuple(row) not in rows]
    if missing:
        raise ValueError(f"pairwise: include holds tuples that are no valid case: {missing}")
    if len(axes) < 2:
        return rows
    pairs_of = [{(a, repr(row[a]), b, repr(row[b])) for a, b in itertools.combinations(range(len(axes)), 2)}
                for row in rows]
    uncovered = set().union(*pairs_of) if rows else set()
    chosen = [rows.index(tuple(row)) for row in dict.fromkeys(map(tuple, include))]
    for n in chosen:
        uncovered -= pairs_of[n]
    while uncovered:
        # the row covering the most uncovered pairs (the first such in product order)
        best = max(range(len(rows)), key=lambda n: len(pairs_of[n] & uncovered))
        chosen.append(best)
        uncovered -= pairs_of[best]
    return [rows[n] for n in chosen]
