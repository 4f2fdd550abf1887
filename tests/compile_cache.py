"""A worker's cache of ``tvm.compile``: a module compiled again in the same pytest process reuses
the first executable (tests/conftest.py installs it for the session).

Many numeric cases differ only in their inputs (a NaN where another case has an inf, a row of
``do`` zeroed) and build the same module; the TVM-cache tests build TVM's append and copy slots
beside both kernel sets. A module is looked up by its structural hash with the target, both
pipelines and the pass context, and a hit must also print the same TVMScript (names included:
run-time errors name a function's parameters, which structural equality ignores). What a
compile's result can depend on beyond its arguments is not cached: a pipeline given as a pass
object (``tvm_fuel.compile`` passes one that legalizes with the kernels asked for) and a module
still holding calls of fuel's ops (legalized by the pipeline, whose rules a test may patch).
Warnings a compile raised are raised again on every hit.
"""

from __future__ import annotations

import collections
import warnings

import tvm
import tvm_ffi
from tvm import relax

FUEL_OP_PREFIX = "relax.fuel."


def _holds_fuel_calls(mod) -> bool:
    if not isinstance(mod, tvm.IRModule):
        return False
    found = []

    def visit(expr):
        if not found and isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) \
                and expr.op.name.startswith(FUEL_OP_PREFIX):
            found.append(expr)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return bool(found)


def _warn_again(caught):
    """Raise the recorded warnings ``caught`` again, through the filters in force now."""
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


class CompileCache:
    """``compile_fn`` (``tvm.compile``'s signature) with its executables kept, the ``limit`` latest."""

    def __init__(self, compile_fn, limit: int = 64):
        self._compile = compile_fn
        self._limit = limit
        self._entries: collections.OrderedDict = collections.OrderedDict()  # key -> [entry, ...]
        self.hits = self.misses = 0

    def _key(self, mod, target, relax_pipeline, tir_pipeline):
        if not isinstance(mod, (tvm.IRModule, tvm.tirx.PrimFunc)):
            return None
        if not all(p is None or isinstance(p, str) for p in (relax_pipeline, tir_pipeline)):
            return None
        context = tvm.transform.PassContext.current()
        if list(context.instruments) or _holds_fuel_calls(mod):
            return None
        target = target if target is not None else tvm.target.Target.current(allow_none=True)
        return (tvm_ffi.structural_hash(mod), str(target), relax_pipeline, tir_pipeline, int(context.opt_level),
                str(dict(context.config)), tuple(context.required_pass), tuple(context.disabled_pass))

    def __call__(self, mod, target=None, *, relax_pipeline="default", tir_pipeline="default"):
        key = self._key(mod, target, relax_pipeline, tir_pipeline)
        if key is None:
            return self._compile(mod, target, relax_pipeline=relax_pipeline, tir_pipeline=tir_pipeline)
        script = None
        for entry in self._entries.get(key, ()):  # printed only on a hash match: a miss pays the hash alone
            if tvm_ffi.structural_hash(entry["mod"]) != key[0]:
                continue  # edited in place since (IRModule.update_func): its executable is another module's
            script = script or mod.script()
            entry["script"] = entry["script"] or entry["mod"].script()
            if entry["script"] == script:
                self._entries.move_to_end(key)
                self.hits += 1
                _warn_again(entry["warnings"])
                return entry["executable"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            executable = self._compile(mod, target, relax_pipeline=relax_pipeline, tir_pipeline=tir_pipeline)
        _warn_again(caught)
        self.misses += 1
        self._entries.setdefault(key, []).append(
            dict(mod=mod, script=script, executable=executable, warnings=caught))
        self._entries.move_to_end(key)
        while len(self._entries) > self._limit:
            self._entries.popitem(last=False)
        return executable
