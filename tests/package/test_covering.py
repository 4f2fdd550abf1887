"""``tests/covering.pairwise``: every pair of values of any two axes is in some tuple, and the
array is much smaller than the product where the product is large."""

from __future__ import annotations

import itertools

import pytest
from covering import pairwise

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("sizes", [(2, 2), (3, 3, 3), (3, 4, 2, 5), (2, 2, 2, 2, 2, 2, 2), (5, 1, 3)])
def test_every_pair_is_covered(sizes):
    axes = [[f"a{n}v{i}" for i in range(size)] for n, size in enumerate(sizes)]
    rows = pairwise(*axes)
    assert all(len(row) == len(axes) and all(row[n] in axes[n] for n in range(len(axes))) for row in rows)
    for a, b in itertools.combinations(range(len(axes)), 2):
        assert {(row[a], row[b]) for row in rows} == set(itertools.product(axes[a], axes[b]))
    assert len(rows) == len(set(rows)) and pairwise(*axes) == rows  # no repeats; deterministic


def test_it_is_smaller_than_the_product():
    assert len(pairwise(*[range(3)] * 5)) <= 15 < 3 ** 5
    assert len(pairwise(range(2), range(3))) == 6  # two axes: every pair is the product
    assert pairwise(range(3)) == [(0,), (1,), (2,)] and pairwise(range(2), []) == []


def test_only_valid_tuples_and_their_pairs():
    def valid(a, b, c):
        return not (a == 2 and b == "y")  # (2, "y") is no case: its pairs need not be covered

    rows = pairwise([0, 1, 2], ["x", "y"], [True, False], valid=valid)
    assert all(valid(*row) for row in rows)
    possible = [row for row in itertools.product([0, 1, 2], ["x", "y"], [True, False]) if valid(*row)]
    for a, b in itertools.combinations(range(3), 2):
        assert {(row[a], row[b]) for row in rows} == {(row[a], row[b]) for row in possible}


def test_included_tuples_come_first_and_the_array_is_completed_around_them():
    axes = ([0, 1, 2], ["x", "y"], [True, False])
    rows = pairwise(*axes, include=[(2, "y", False), (0, "x", True)])
    assert rows[:2] == [(2, "y", False), (0, "x", True)] and len(rows) == len(set(rows))
    for a, b in itertools.combinations(range(3), 2):
        assert {(row[a], row[b]) for row in rows} == {(row[a], row[b]) for row in itertools.product(*axes)}
    with pytest.raises(ValueError, match="include holds tuples that are no valid case"):
        pairwise(*axes, valid=lambda a, b, c: a != 2, include=[(2, "x", True)])
