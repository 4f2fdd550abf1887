"""Comparing a kernel's outputs with what they should be, per dtype (the test suite's tolerances).

Contents:
    TOLERANCE     -- (atol, rtol) of an output against the float64 reference, per input dtype
    LSE_TOLERANCE -- (atol, rtol) of the log-sum-exp (float32 whatever the input dtype)
    DEVICE_SCALE  -- the least tolerance scale on a GPU (tensor-core accumulation order, fast exp)
    compare       -- one output against its expected values: ok, errors, and why not
"""

from __future__ import annotations

import numpy as np

# (atol, rtol) of an op's float output against the float64 reference on the same (rounded) inputs:
# accumulation is float32, so the output rounding of the dtype dominates.
TOLERANCE = {"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}
LSE_TOLERANCE = (1e-5, 1e-5)
DEVICE_SCALE = 4.0


def compare(what: str, actual: np.ndarray, expected: np.ndarray, tolerance: tuple[float, float],
            scale: float = 1.0) -> dict:
    """``{"what", "ok", "max_abs_err", "max_excess", "why"}``: ``actual`` within
    ``atol + rtol * |expected|`` (both times ``scale``) everywhere; infinities must agree exactly
    (a fully masked row's lse is −inf) and no NaN may appear where none is expected."""
    actual = np.asarray(actual).astype(np.float64)
    expected = np.asarray(expected).astype(np.float64)
    result = {"what": what, "ok": True, "max_abs_err": 0.0, "max_excess": 0.0, "why": ""}
    if actual.shape != expected.shape:
        return {**result, "ok": False, "why": f"shape {actual.shape}, expected {expected.shape}"}
    nan = np.isnan(actual) & ~np.isnan(expected)
    if nan.any():
        return {**result, "ok": False, "why": f"{int(nan.sum())} NaN, first at {np.argwhere(nan)[0].tolist()}"}
    infinite = np.isinf(expected) | np.isinf(actual)
    if (actual[infinite] != expected[infinite]).any():
        first = np.argwhere(infinite & (actual != expected))[0].tolist()
        return {**result, "ok": False, "why": f"infinities disagree, first at {first}"}
    finite = ~infinite & ~np.isnan(expected)
    if not finite.any():
        return result
    atol, rtol = tolerance
    error = np.abs(actual[finite] - expected[finite])
    excess = error / (scale * (atol + rtol * np.abs(expected[finite])))
    result.update(max_abs_err=float(error.max()), max_excess=float(excess.max()))
    if excess.max() > 1.0:
        worst = np.argwhere(finite)[int(excess.argmax())].tolist()
        result.update(ok=False, why=f"error {error.max():.3e} is {excess.max():.2f}x the tolerance, worst at {worst}")
    return result
