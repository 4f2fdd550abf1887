"""The suite's compile cache (tests/compile_cache.py): what it reuses and what it never does."""

import inspect
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_fuel
from compile_cache import CompileCache

pytestmark = pytest.mark.unit


def _module(name: str = "x", scale: float = 2.0) -> tvm.IRModule:
    x = relax.Var(name, relax.TensorType((4,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(relax.op.multiply(x, relax.const(scale, "float32"))))
    return bb.get()


class Counting:
    """tvm.compile, counted, with a warning per call; ``build=False`` answers a placeholder."""

    def __init__(self, build: bool = False):
        self.calls, self.build = [], build

    def __call__(self, mod, target=None, **pipelines):
        self.calls.append(mod)
        warnings.warn(f"compiled {len(self.calls)}", UserWarning)
        return tvm.compile(mod, target, **pipelines) if self.build else object()


def test_the_same_module_compiles_once_and_its_warnings_come_again():
    cached = CompileCache(counting := Counting(build=True))
    with pytest.warns(UserWarning, match="compiled 1"):
        first = cached(_module(), "llvm")
    with pytest.warns(UserWarning, match="compiled 1"):
        again = cached(_module(), "llvm")  # another object, the same module
    assert again is first and len(counting.calls) == 1 and (cached.hits, cached.misses) == (1, 1)
    vm = relax.VirtualMachine(again, tvm.cpu())
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(np.ones(4, "float32"))).numpy(), 2)


@pytest.mark.parametrize("other", [
    lambda cached: cached(_module(scale=3.0), "llvm"),  # another constant
    lambda cached: cached(_module(name="y"), "llvm"),  # structurally equal, another parameter name
    lambda cached: cached(_module(), tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"})),  # another target
    lambda cached: cached(_module(), "llvm", relax_pipeline="zero"),
], ids=["constant", "parameter-name", "target", "pipeline"])
def test_anything_else_compiles_anew(other):
    cached = CompileCache(counting := Counting())
    with pytest.warns(UserWarning):
        cached(_module(), "llvm")
        other(cached)
    assert len(counting.calls) == 2


def test_a_pass_object_pipeline_or_a_fuel_call_is_never_cached():
    cached = CompileCache(counting := Counting())
    with pytest.warns(UserWarning):
        for _ in range(2):
            cached(_module(), "llvm", relax_pipeline=relax.get_pipeline("zero"))
    q = relax.Var("q", relax.TensorType((1, 2, 3, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q]):
        bb.emit_func_output(bb.emit(tvm_fuel.op.flash_attn(q, q, q)))
    fused = bb.get()
    assert "fuel" in fused.script()
    with pytest.warns(UserWarning):
        for _ in range(2):
            cached(fused, "llvm")
    assert len(counting.calls) == 4 and cached.hits == 0


def test_a_module_edited_after_its_compile_is_not_taken_for_the_edit():
    cached = CompileCache(counting := Counting())
    mod = _module()
    with pytest.warns(UserWarning):
        cached(mod, "llvm")
        mod.update_func(mod.get_global_var("main"), _module(scale=5.0)["main"])
        cached(_module(), "llvm")
    assert len(counting.calls) == 2


def test_the_suite_runs_with_it_installed(pytestconfig):
    compile_fn = inspect.unwrap(tvm.compile)  # under --compile-report: the clock's wrapper around it
    assert isinstance(compile_fn, CompileCache) != pytestconfig.getoption("no_compile_cache")
