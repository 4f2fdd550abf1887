"""Frozen option records shared by every layer (constructors, type rules, TE, references).

Contents:
    AttnConfig   -- the semantic options of every attention op (scale, causal, window, softcap, sink tokens)
    FLOAT_DTYPES -- dtypes the attention ops accept for q, k, v, do
    INDEX_DTYPES -- dtypes accepted for block tables and context lengths
    MAX_WINDOW   -- the largest window side accepted (2**31 - 1)
    as_int, as_bool, finite_nonzero_float32 -- the argument checks every op and the CLI share
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "uint32", "int64")
MAX_WINDOW = 2**31 - 1  # the largest window_size side accepted (-1 is unbounded)


@dataclass(frozen=True)
class AttnConfig:
    """Options of an attention op, FlashAttention-2 conventions.

    ``window_size = (left, right)``: key ``j`` is kept for query ``i`` iff
    ``i + delta - left <= j <= i + delta + right`` with ``delta = Sk - Sq`` (bottom-right aligned);
    -1 means unbounded on that side. ``causal`` means ``right = 0`` (the left bound is kept).
    ``softcap > 0`` maps a logit ``s`` to ``softcap * tanh(s / softcap)``.
    ``sink_tokens = n`` (StreamingLLM's attention sinks; the sink tokens of TVM's KV cache): keys
    ``j < n`` stay visible past the window's left bound (the right bound and the length still apply).
    """

    softmax_scale: float | None = None
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sink_tokens: int = 0

    @staticmethod
    def create(op: str, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               sink_tokens=0) -> AttnConfig:
        """Validate raw option values, naming ``op`` in any error, and return the config."""
        if softmax_scale is not None:
            softmax_scale = _as_real(op, "softmax_scale", softmax_scale, "a float or None")
            if not finite_nonzero_float32(softmax_scale):  # the kernels scale the logits in float32
                raise ValueError(f"{op}: softmax_scale must be finite and non-zero as a float32 "
                                 f"({_F32_RANGE}), got {softmax_scale!r}")
        causal = as_bool(op, "causal", causal)
        if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
            raise ValueError(f"{op}: window_size must be a pair (left, right), got {window_size!r}")
        window = tuple(as_int(op, f"window_size {side}", w) for side, w in zip(("left", "right"), window_size))
        for side, w in zip(("left", "right"), window):
            if w < -1:
                raise ValueError(f"{op}: window_size {side} must be -1 (unbounded) or >= 0, got {w}")
            if w > MAX_WINDOW:  # past any sequence length anyway; keeps the kernels' int64 index sums exact
                raise ValueError(f"{op}: window_size {side} must be at most 2**31 - 1 (use -1 for unbounded), got {w}")
        softcap = _as_real(op, "softcap", softcap, "a float")
        if softcap < 0:
            raise ValueError(f"{op}: softcap must be >= 0 (0 disables it), got {softcap!r}")
        if softcap != 0 and not finite_nonzero_float32(softcap):  # the kernels divide by it in float32
            raise ValueError(f"{op}: softcap must be finite and non-zero as a float32 ({_F32_RANGE}) "
                             f"or 0 (disabled), got {softcap!r}")
        sink_tokens = as_int(op, "sink_tokens", sink_tokens)
        if not 0 <= sink_tokens <= MAX_WINDOW:
            raise ValueError(f"{op}: sink_tokens must be between 0 (none) and 2**31 - 1, got {sink_tokens}")
        return AttnConfig(softmax_scale, causal, window, softcap, sink_tokens)

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
            sink_tokens=attrs["sink_tokens"] if "sink_tokens" in attrs else 0,  # written only when not 0
        )

    def options(self) -> dict[str, Any]:
        """The keyword arguments of an op constructor that make this config (Python values)."""
        return {"softmax_scale": self.softmax_scale, "causal": self.causal, "window_size": self.window_size,
                "softcap": self.softcap, **({"sink_tokens": self.sink_tokens} if self.sink_tokens else {})}

    def to_attrs(self) -> dict[str, Any]:
        """The attribute dict stored on a Relax call (prints as keyword arguments); ``sink_tokens``
        only when not 0, so calls without it print and compare as before it existed."""
        return {
            "softmax_scale": self.softmax_scale,
            "causal": self.causal,
            "window_size": list(self.window_size),
            "softcap": self.softcap,
            **({"sink_tokens": self.sink_tokens} if self.sink_tokens else {}),
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


def as_int(op: str, name: str, value: Any) -> int:
    """``value`` as a Python int: ints, numpy integers and TIR IntImms qualify; bools (Python or
    numpy) and floats do not. TypeError names ``op`` and ``name``."""
    if type(value).__name__ == "IntImm":  # read back from a call's attributes
        if value.dtype == "bool":
            raise TypeError(f"{op}: {name} must be an int, not a bool, got {value!r}")
        return int(value.value)
    if isinstance(value, (bool, np.bool_)):  # an int subclass, but True as a size is a mistake
        raise TypeError(f"{op}: {name} must be an int, not a bool, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {name} must be an int, got {value!r}") from None


def positive_int(op: str, name: str, value: Any) -> int:
    """``value`` as an int >= 1 (``as_int``'s rules); ValueError naming ``op`` and ``name`` below 1."""
    value = as_int(op, name, value)
    if value < 1:
        raise ValueError(f"{op}: {name} must be a positive int, got {value}")
    return value


def as_bool(op: str, name: str, value: Any) -> bool:
    """``value`` as a Python bool: only bools and numpy bools qualify (``causal=2`` is a mistake)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be a bool (True or False), got {value!r}")
    return bool(value)


def _as_real(op: str, name: str, value: Any, expected: str) -> float:
    """``value`` as a Python float: ints, floats and numpy reals qualify; bools do not."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be {expected}, got {value!r}")
    return float(value)


_F32_RANGE = "1.4e-45 <= |x| <= 3.4e+38"  # the smallest subnormal and the largest finite float32


def finite_nonzero_float32(value: float) -> bool:
    """Whether ``value`` stays finite and non-zero when rounded to float32."""
    with np.errstate(over="ignore", under="ignore"):
        rounded = float(np.float32(value))
    return math.isfinite(rounded) and rounded != 0
