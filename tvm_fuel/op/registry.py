"""Registers the fuel ops with TVM (type rule, purity, legalization) and with the TVMScript parser.

Runs once on ``import tvm_fuel``; registering again (pytest re-imports, reloads) is a no-op.
After it, ``R.fuel.<name>(...)`` in a printed module parses back: printed calls carry the
``has_<arg>`` attributes and are rebuilt as they are; hand-written ones use the constructor.
Their gradients are registered by ``tvm_fuel.autodiff``.
"""

from __future__ import annotations

import types

import tvm
from tvm.ir import Op
from tvm.relax.transform.legalize_ops.common import register_legalize

from . import attention, norm
from .infer import INFER
from .legalize import LEGALIZE
from .spec import SPECS, OpSpec


def _registered(name: str) -> bool:
    try:
        return Op.get(name).has_attr("FInferType")
    except AttributeError:  # not registered yet
        return False


def _script_builder(spec: OpSpec):
    constructor = getattr(attention, spec.name, None) or getattr(norm, spec.name)

    def build(*args, **attrs):
        if any(key.startswith("has_") for key in attrs):  # the printed form: arguments + raw attributes
            present = [o for o in spec.optional if bool(attrs.get(f"has_{o}", False))]
            named = dict(zip(list(spec.required) + present, args))
            rest = {k: v for k, v in attrs.items() if not k.startswith("has_")}
            return spec.make_call(named, rest)
        return constructor(*args, **attrs)

    build.__name__ = spec.name
    return build


def register() -> None:
    """Register every fuel op and the ``R.fuel`` TVMScript namespace (idempotent)."""
    for name, spec in SPECS.items():
        if _registered(spec.op_name):
            continue
        tvm.ir.register_op_attr(spec.op_name, "FInferType", INFER[name])
        tvm.ir.register_op_attr(spec.op_name, "FPurity", True)
        register_legalize(spec.op_name, LEGALIZE[name])
    import tvm.relax.script as relax_script
    import tvm.relax.script.parser as relax_parser

    namespace = types.SimpleNamespace(**{name: _script_builder(spec) for name, spec in SPECS.items()})
    relax_script.fuel = relax_parser.fuel = namespace
