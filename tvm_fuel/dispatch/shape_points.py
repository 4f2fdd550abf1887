"""``ShapePoint``: a Relax function's symbolic dims bound to values, a point a model is dispatched at.

``tvm_fuel.specialize`` adds a static copy of a function per point and dispatches a call whose dims
equal a point's to it; the ``model`` folder of the tuning logs keeps the points a model was tuned at
(``records.write_points``), so a build specializes there and the static copy meets its records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class ShapePoint:
    """``function`` (a Relax function's name) with its symbolic dims ``dims`` (name -> value)."""

    function: str
    dims: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self):
        for name, value in self.dims.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tvm_fuel.specialize: dim {name} of {self.function} must be a positive int, "
                                 f"got {value!r}")

    def suffix(self) -> str:
        return "__at_" + "_".join(f"{re.sub(r'[^0-9A-Za-z]', '', k)}{v}" for k, v in sorted(self.dims.items()))

    def to_json(self) -> dict:
        return {"function": self.function, "dims": dict(self.dims)}

    @classmethod
    def from_json(cls, data: dict) -> "ShapePoint":
        return cls(str(data["function"]), {str(k): int(v) for k, v in dict(data["dims"]).items()})


__all__ = ["ShapePoint"]
