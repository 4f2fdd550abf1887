"""``tvm_fuel.compat``: every patch of TVM in one place, each naming the TVM it applies to and
what upstream it works around, all applied by ``import tvm_fuel`` and none twice."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest
import tvm

import tvm_fuel
from tvm_fuel import autodiff, compat
from tvm_fuel.compat import threads, torch_importer, tvmscript

pytestmark = pytest.mark.unit

MODULES = sorted(info.name for info in pkgutil.iter_modules(compat.__path__))


@pytest.mark.parametrize("name", MODULES)
def test_each_patch_names_its_tvm_and_the_upstream_code(name):
    doc = importlib.import_module(f"tvm_fuel.compat.{name}").__doc__
    assert "Applies to: TVM 0.27.0. Works around: ``" in doc, name
    assert re.search(r"``(python/tvm|src)/[\w/]+\.(py|cc)``", doc), name
    assert f"    {name} " in compat.__doc__, f"tvm_fuel.compat's docstring does not list {name}"


def test_import_installed_every_patch_and_a_second_install_changes_nothing():
    from tvm.script.parser.core.diagnostics import Source
    from tvm.script.parser.core.parser import ScriptMacro

    assert tvm_fuel.threads is threads  # (the name tvm_fuel documents)
    assert ScriptMacro._find_parser_def.__module__ == tvmscript.__name__  # noqa: SLF001
    assert Source.as_ast.__module__ == Source.__init__.__module__ == tvmscript.__name__
    for name in autodiff.RELAX_GRADIENTS:
        assert tvm.ir.Op.get(name).get_attr("FPrimalGradient") is not None, name
    again = compat.install()
    assert again["threads"] == {} and again["relax_gradients"] == []
    assert again["tvmscript"]["macro_lookup"] and again["tvmscript"]["shared_sources"]
    assert "tvm.tirx.script.parser.entry" in again["tvmscript"]["entry_stacks"]


def test_a_callers_converter_takes_precedence_over_ours():
    mine = object()
    assert torch_importer.convert_map()["cumsum.default"] is torch_importer.cumsum
    assert torch_importer.convert_map({"cumsum.default": mine})["cumsum.default"] is mine
    assert set(torch_importer.convert_map({"sort.default": mine})) == {"cumsum.default", "sort.default"}
