"""A case's inputs from its spec: the same arrays wherever they are made (seeded numpy, no TVM):
here (the tuner's measurements, the tests) and on a node (a copy in the bundle's ``fuel_node/``).

A bundle stores no data: each input is ``{"name", "shape", "dtype", "fill", ...}`` and a case
has a ``seed``. Fills: ``normal`` (standard normal times ``scale``), ``keep`` (a bool mask,
True with probability ``p``), ``slopes`` (ALiBi's geometric slopes for the heads), ``blocks``
(a block table of distinct block ids below ``num_blocks``, −1 after each sequence's live blocks
when ``lens`` are given), ``values`` (the given numbers), ``lse`` (a finite log-sum-exp near
log ``keys``), ``codes`` (an int8 cache's codes in [-127, 127]), ``uniform`` (in [``low``,
``high``): a quantized cache's scales).

Contents:
    numpy_dtype, make_arrays, make_array
"""

from __future__ import annotations

import math

import numpy as np


def numpy_dtype(name: str):
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return getattr(ml_dtypes, name)
    return np.dtype(name)


def make_arrays(specs: list[dict], seed: int) -> list[np.ndarray]:
    """The arrays of ``specs``, in order, from one generator seeded with ``seed``."""
    rng = np.random.default_rng(seed)
    return [make_array(rng, spec) for spec in specs]


def make_array(rng: np.random.Generator, spec: dict) -> np.ndarray:
    shape, dtype, fill = tuple(spec["shape"]), spec["dtype"], spec.get("fill", "normal")
    if fill == "normal":
        return (rng.standard_normal(shape) * spec.get("scale", 1.0)).astype(numpy_dtype(dtype))
    if fill == "keep":
        return rng.random(shape) < spec.get("p", 0.8)
    if fill == "codes":  # an int8 cache's codes
        return rng.integers(-127, 128, shape).astype(dtype)
    if fill == "uniform":  # in [low, high): quantized caches' scales
        return rng.uniform(spec["low"], spec["high"], shape).astype(dtype)
    if fill == "slopes":
        (heads,) = shape
        return np.array([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype)
    if fill == "values":
        return np.array(spec["values"], dtype).reshape(shape)
    if fill == "lse":
        return (math.log(max(spec.get("keys", 2), 2)) + rng.random(shape)).astype(dtype)
    if fill == "blocks":
        batch, max_blocks = shape
        ids = rng.permutation(spec["num_blocks"])
        table = np.resize(ids, batch * max_blocks).reshape(batch, max_blocks).astype(dtype)
        for row, length in enumerate(spec.get("lens") or []):
            table[row, -(-length // spec["block_size"]):] = -1  # padding past the live blocks
        return table
    raise ValueError(f"unknown fill {fill!r} of input {spec.get('name')!r}")
