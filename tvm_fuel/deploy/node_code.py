"""The node's code as a bundle holds it: ``fuel_node/`` = ``deploy/node`` + ``testing/{arrays,compare,peers}``
+ ``reference``.

The node's modules import those as siblings (``from .arrays import make_arrays``), which they are
only in ``fuel_node/``: inside the repo they are only ever run from such a copy, a bundle's
(``bundle``) or, for the tests that call node code in their own process, ``node_module``'s.

Contents:
    FROM_TESTING -- the ``tvm_fuel.testing`` modules the node imports
    write_node   -- write ``fuel_node/`` into a folder
    node_module  -- one of the node's modules, imported from a copy of ``fuel_node/``
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

_PACKAGE = Path(__file__).resolve().parent.parent  # tvm_fuel/
FROM_TESTING = ("arrays", "compare", "peers")
_COPIES: list[tempfile.TemporaryDirectory] = []  # node_module's copy, removed when this process exits


def write_node(folder: Path) -> Path:
    """Write ``folder / "fuel_node"``: the node's package (``tvm_fuel/deploy/node``), the testing
    modules it imports (``FROM_TESTING``) and ``tvm_fuel/reference.py`` beside them; returns it."""
    node = Path(folder) / "fuel_node"
    shutil.copytree(_PACKAGE / "deploy" / "node", node, ignore=shutil.ignore_patterns("__pycache__"))
    for name in FROM_TESTING:
        shutil.copy(_PACKAGE / "testing" / f"{name}.py", node / f"{name}.py")
    shutil.copy(_PACKAGE / "reference.py", node / "reference.py")
    return node


def node_module(name: str) -> ModuleType:
    """``fuel_node.<name>`` (e.g. ``"tvm_slots"``) in this process, as a bundle's run.py imports it:
    the package ``fuel_node`` is loaded once from a copy written to a temporary folder (the repo's
    ``deploy/node`` lacks the siblings the node's modules import)."""
    if "fuel_node" not in sys.modules:
        copy = tempfile.TemporaryDirectory(prefix="tvm_fuel-node-")
        _COPIES.append(copy)
        node = write_node(Path(copy.name))
        spec = importlib.util.spec_from_file_location("fuel_node", node / "__init__.py",
                                                      submodule_search_locations=[str(node)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["fuel_node"] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"fuel_node.{name}")


__all__ = ["FROM_TESTING", "write_node", "node_module"]
