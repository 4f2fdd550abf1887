"""``RepairImportedProgram``: what TVM 0.27's PyTorch importer mistranslates, given PyTorch's meaning.

A bool ``cumsum`` (transformers' packed-sequence ids) counts in int64, and a constant negative
``take`` index (``x[..., [-2], :]``, Falcon's multi-query split) counts from the end: checked on
Relax built by hand against numpy, and on a PyTorch module exported, imported through
``tvm_fuel.frontend`` and built, against PyTorch.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

import tvm_fuel
import tvm_fuel.frontend
from tvm_fuel.transform import RepairImportedProgram

pytestmark = pytest.mark.numerics


def _module(build, *params) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    with bb.function("main", list(params)):
        bb.emit_func_output(build(bb, *params))
    return bb.get()


def _run(mod: tvm.IRModule, *args) -> np.ndarray:
    vm = relax.VirtualMachine(tvm_fuel.compile(mod, "llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _ops(mod: tvm.IRModule) -> list[relax.Call]:
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return found


def test_a_bool_cumsum_counts_in_int64():
    x = relax.Var("x", relax.TensorType([2, 9], "bool"))
    mod = _module(lambda bb, x: bb.emit(relax.op.cumsum(x, axis=-1)), x)  # as the importer writes it
    assert str(mod["main"].ret_ty.dtype) == "bool"
    repaired = RepairImportedProgram()(mod)
    assert str(repaired["main"].ret_ty.dtype) == "int64"
    data = np.random.default_rng(0).random((2, 9)) > 0.5
    np.testing.assert_array_equal(_run(repaired, data), np.cumsum(data, axis=-1))
    np.testing.assert_array_equal(_run(mod, data), np.cumsum(data, axis=-1))  # compile repairs it too


@pytest.mark.parametrize("indices, kept", [([-2], [1]), ([0, -1, -3], [0, 2, 0])])
def test_negative_constant_take_indices_count_from_the_end(indices, kept):
    x = relax.Var("x", relax.TensorType([2, 3, 4], "float32"))
    mod = _module(lambda bb, x: bb.emit(relax.op.take(x, relax.const(np.array(indices, "int64")), 1, mode="fast")), x)
    repaired = RepairImportedProgram()(mod)
    (take,) = [c for c in _ops(repaired) if c.op.name == "relax.take"]
    np.testing.assert_array_equal(take.args[1].value.numpy(), kept)
    data = np.arange(24, dtype="float32").reshape(2, 3, 4)
    np.testing.assert_array_equal(_run(repaired, data), np.take(data, indices, axis=1))


def test_what_needs_no_repair_is_left_as_it_is():
    x = relax.Var("x", relax.TensorType([2, 3], "float32"))
    i = relax.Var("i", relax.TensorType([1], "int64"))
    n = relax.Var("n", relax.TensorType([2, 3], "int32"))

    def build(bb, x, i, n):
        out_of_range = bb.emit(relax.op.take(x, relax.const(np.array([-4], "int64")), 1))  # PyTorch rejects it too
        by_tensor = bb.emit(relax.op.take(x, i, 1))
        counts = bb.emit(relax.op.cumsum(n, axis=1))
        return bb.emit(relax.Tuple([out_of_range, by_tensor, counts]))

    mod = _module(build, x, i, n)
    assert tvm_ffi.structural_equal(RepairImportedProgram()(mod), mod)


def test_an_exported_module_builds_from_ids_as_torch_runs_it():
    torch = pytest.importorskip("torch")

    class Ids(torch.nn.Module):
        def forward(self, ids):
            starts = (ids != 1).cumsum(-1)  # a bool cumsum
            return starts[..., [-2]] * 10 + ids[..., [-1]]  # negative indices

    ids = torch.tensor([[1, 2, 1, 1, 5], [3, 1, 1, 4, 1]])
    program = torch.export.export(Ids(), (ids,))
    mod = tvm_fuel.frontend.from_exported_program(program)
    out = relax.VirtualMachine(tvm_fuel.compile(mod, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(ids.numpy()))
    np.testing.assert_array_equal(out[0].numpy(), Ids()(ids).numpy())
