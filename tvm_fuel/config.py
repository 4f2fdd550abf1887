"""Frozen option records shared by every layer (constructors, type rules, TE, references).

Contents:
    AttnConfig   -- the semantic options of every attention op (scale, causal, window, softcap)
    FLOAT_DTYPES -- dtypes the attention ops accept for q, k, v, do
    INDEX_DTYPES -- dtypes accepted for block tables and context lengths
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "uint32", "int64")


@dataclass(frozen=True)
class AttnConfig:
    """Options of an attention op, FlashAttention-2 conventions.

    ``window_size = (left, right)``: key ``j`` is kept for query ``i`` iff
    ``i + delta - left <= j <= i + delta + right`` with ``delta = Sk - Sq`` (bottom-right aligned);
    -1 means unbounded on that side. ``causal`` means ``right = 0`` (the left bound is kept).
    ``softcap > 0`` maps a logit ``s`` to ``softcap * tanh(s / softcap)``.
    """

    softmax_scale: float | None = None
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0

    @staticmethod
    def create(op: str, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0) -> AttnConfig:
        """Validate raw option values, naming ``op`` in any error, and return the config."""
        if softmax_scale is not None:
            if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
                raise TypeError(f"{op}: softmax_scale must be a float or None, got {softmax_scale!r}")
            if not math.isfinite(softmax_scale) or softmax_scale == 0:
                raise ValueError(f"{op}: softmax_scale must be finite and non-zero, got {softmax_scale!r}")
            softmax_scale = float(softmax_scale)
        if not isinstance(causal, (bool, int)):
            raise TypeError(f"{op}: causal must be a bool, got {causal!r}")
        if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
            raise ValueError(f"{op}: window_size must be a pair (left, right), got {window_size!r}")
        window = tuple(_as_int(op, f"window_size {side}", w) for side, w in zip(("left", "right"), window_size))
        for side, w in zip(("left", "right"), window):
            if w < -1:
                raise ValueError(f"{op}: window_size {side} must be -1 (unbounded) or >= 0, got {w}")
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"{op}: softcap must be a float, got {softcap!r}")
        if not math.isfinite(softcap) or softcap < 0:
            raise ValueError(f"{op}: softcap must be >= 0 (0 disables it), got {softcap!r}")
        return AttnConfig(softmax_scale, bool(causal), window, float(softcap))

    @staticmethod
    def from_attrs(op: str, attrs: Mapping[str, Any]) -> AttnConfig:
        """Read and validate the config stored in a Relax call's attributes."""
        missing = [key for key in ATTN_ATTR_KEYS if key not in attrs]
        if missing:
            raise ValueError(f"{op}: call is missing the attributes {missing}")
        return AttnConfig.create(
            op,
            softmax_scale=attrs["softmax_scale"],
            causal=attrs["causal"],
            window_size=list(attrs["window_size"]),
            softcap=attrs["softcap"],
        )

    def to_attrs(self) -> dict[str, Any]:
        """The attribute dict stored on a Relax call (prints as keyword arguments)."""
        return {
            "softmax_scale": self.softmax_scale,
            "causal": self.causal,
            "window_size": list(self.window_size),
            "softcap": self.softcap,
        }

    @property
    def window_left(self) -> int:
        """Keys at most this far left of the diagonal are kept; -1 is unbounded."""
        return self.window_size[0]

    @property
    def window_right(self) -> int:
        """Keys at most this far right of the diagonal are kept; -1 is unbounded."""
        return 0 if self.causal else self.window_size[1]

    def scale_for(self, head_dim: int) -> float:
        """The logit scale: ``softmax_scale`` or ``1 / sqrt(head_dim)``."""
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(head_dim)


ATTN_ATTR_KEYS = ("softmax_scale", "causal", "window_size", "softcap")


def _as_int(op: str, name: str, value: Any) -> int:
    """``value`` as a Python int (ints, numpy ints and TIR IntImms qualify; bools and floats do not)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        if type(value).__name__ != "IntImm":
            raise TypeError(f"{op}: {name} must be an int, got {value!r}")
        return int(value.value)
    return int(value)
