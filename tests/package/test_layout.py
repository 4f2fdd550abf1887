"""The package's layout: its import graph has no cycle and points downward only (ops, then kernels
and gradients, then passes, the build, tuning, and the commands on top), no module imports
another's private names, the top level stays small and no source file is long; every test
module declares its tier (issue 30)."""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# the layer of each module (its longest matching prefix): a module may import its own layer and those below
LAYERS = {
    # leaves: no tvm_fuel import outside themselves (deploy.node runs on GPU nodes without TVM)
    "tvm_fuel.diagnostics": 0, "tvm_fuel.target": 0, "tvm_fuel.reference": 0,
    # the patches of TVM (tvm_fuel.compat): each a leaf, but the gradients (autodiff's) and install (all of them)
    "tvm_fuel.compat.threads": 0, "tvm_fuel.compat.tvmscript": 0, "tvm_fuel.compat.torch_importer": 0,
    "tvm_fuel.testing": 0, "tvm_fuel.tuning_logs": 0,
    "tvm_fuel.outputs": 0,
    "tvm_fuel.op": 1,
    "tvm_fuel.schedules": 2, "tvm_fuel.autodiff": 2, "tvm_fuel.compat": 2,
    "tvm_fuel.dispatch": 3,  # the route from a fused call to its kernel (or the floor), the tuning records
    "tvm_fuel.transform": 4,
    "tvm_fuel.build": 5, "tvm_fuel.nn": 5, "tvm_fuel.kv_cache": 5, "tvm_fuel.frontend": 5,
    "tvm_fuel.tuning": 6, "tvm_fuel.models": 6,
    "tvm_fuel.bench": 7, "tvm_fuel.deploy": 7, "tvm_fuel.demo": 7,
    "tvm_fuel.cli": 8, "tvm_fuel.__main__": 8,
}


def _modules() -> dict[str, Path]:
    found = {}
    for root, prefix in ((REPO / "tvm_fuel", "tvm_fuel"), (REPO / "schedules", "tvm_fuel.schedules"),
                         (REPO / "tuning_logs", "tvm_fuel.tuning_logs")):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((prefix, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for each tvm_fuel import of ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "tvm_fuel":
                continue
            names = [a.name for a in node.names]
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
            found += [(sub, []) for sub in submodules]
            # (the root's dunders, ``__version__``, are facts of the package, not a dependency on its modules)
            rest = [n for n in names if f"{module}.{n}" not in MODULES and not n.startswith("__")]
            if rest:  # (``from . import a, b`` of modules alone runs the package, imported already)
                found.append((module, rest))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "tvm_fuel"]
    return found


def _layer(name: str) -> int:
    if name == "tvm_fuel":
        return 9
    prefix = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len, default=None)
    assert prefix is not None, f"{name} has no layer in test_layout.LAYERS: add it where it belongs"
    return LAYERS[prefix]


def _edges() -> dict[str, set[str]]:
    return {name: {m for m, _ in _imports(name, path) if m in MODULES and m != name}
            for name, path in MODULES.items()}


def _cycle(edges: dict[str, set[str]], skip: set[str]) -> list[str] | None:
    """A cycle among the modules (package ``__init__``s in ``skip`` left out), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node] - skip):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(set(edges) - skip):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    # a package's __init__ re-exports its modules (the public names): a module importing the names of
    # its own package's __init__ would be a cycle, so they are kept, except the root's (which imports all)
    assert _cycle(_edges(), skip={"tvm_fuel"}) is None


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}, skip=set()) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}, skip=set()) is None


def test_imports_point_downward():
    upward = [f"{name} (layer {_layer(name)}) imports {dep} (layer {_layer(dep)})"
              for name, deps in _edges().items() for dep in deps if _layer(dep) > _layer(name)]
    assert upward == []


def test_no_private_name_is_imported_from_another_module():
    private = [f"{name} imports {n} from {module}" for name, path in MODULES.items()
               for module, names in _imports(name, path) for n in names
               if n.startswith("_") and not n.startswith("__") and module != name]
    assert private == []


def test_the_top_level_is_small_and_no_source_file_is_long():
    top = sorted(p.name for p in (REPO / "tvm_fuel").glob("*.py"))
    assert len(top) <= 12, top
    long = [f"{path.relative_to(REPO)}: {n} lines" for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > 600]
    assert long == []


def test_every_module_declares_one_tier():
    import conftest

    bare, both, one = (types.ModuleType(name) for name in ("bare", "both", "one"))
    both.pytestmark = [pytest.mark.unit, pytest.mark.numerics]
    one.pytestmark = [pytest.mark.numerics, pytest.mark.slow]
    for module in (bare, both):
        with pytest.raises(pytest.UsageError, match="declare exactly one tier"):
            conftest.module_tier(module)
    assert conftest.module_tier(one) == "numerics"


def test_a_new_test_file_without_a_tier_stops_the_collection(tmp_path):
    from helpers import suite_conftest  # (TVM imported only by the tests that copy the suite)

    suite_conftest(tmp_path)
    (tmp_path / "test_tiered.py").write_text("import pytest\npytestmark = pytest.mark.unit\n\n"
                                             "def test_a():\n    pass\n")
    (tmp_path / "test_untiered.py").write_text("def test_b():\n    pass\n")
    # (--no-compile-cache: no TVM import in the inner runs, which check the tiers only)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-compile-cache", "-m",
                          "not slow", "."],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "test_untiered.py: declare exactly one tier" in run.stdout + run.stderr
    (tmp_path / "test_untiered.py").unlink()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-compile-cache", "."],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


def test_every_package_is_installed():
    # a wheel holds the packages pyproject.toml lists: one missing imports from a checkout and not once installed
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    folders = {".".join(("tvm_fuel", *p.relative_to(REPO / "tvm_fuel").parts)) for p in (REPO / "tvm_fuel").rglob("*")
               if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))}
    assert folders <= found, f"folders of modules without __init__.py: {sorted(folders - found)}"
    assert found == listed, (sorted(found - listed), sorted(listed - found))


def _tvm_names(tree: ast.AST) -> set[str]:
    """The names a module binds to TVM's modules and objects (``import tvm``, ``from tvm.x import y``)."""
    names, roots = set(), ("tvm", "tvm_ffi")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in roots}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in roots:
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_only_compat_patches_tvm():
    # a patch of TVM (an attribute of one of its modules or classes replaced) lives in tvm_fuel.compat,
    # one module per defect, where a new TVM release is checked; registering our own names (the ops,
    # TVMScript's R.fuel namespace) extends TVM and is the op package's
    patched = []
    for name, path in MODULES.items():
        if name.startswith("tvm_fuel.compat"):
            continue
        tree = ast.parse(path.read_text())
        tvm_names = _tvm_names(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            patched += [f"{name}:{node.lineno}" for t in targets
                        if isinstance(t, ast.Attribute) and _root(t) in tvm_names and t.attr != "fuel"]
    assert patched == []


def test_the_kernels_read_no_relax():
    # schedules/ maps a Workload to a PrimFunc; the Relax side (a call's workload, the route) is tvm_fuel.dispatch's
    relax = [f"{name} imports {module}" for name, path in MODULES.items() if name.startswith("tvm_fuel.schedules")
             for node in ast.walk(ast.parse(path.read_text()))
             for module in ([a.name for a in node.names] if isinstance(node, ast.Import)
                            else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
             if module == "tvm.relax" or module.startswith("tvm.relax.")
             or (isinstance(node, ast.ImportFrom) and module == "tvm" and "relax" in [a.name for a in node.names])]
    assert relax == []


def test_the_quick_run_takes_each_check_once_per_path(tmp_path):
    from helpers import suite_conftest  # (TVM imported only by the tests that copy the suite)

    suite_conftest(tmp_path)
    (tmp_path / "test_models.py").write_text(
        "import pytest\npytestmark = pytest.mark.integration\n\n"
        "@pytest.mark.parametrize('m', ['p', 'q'])\ndef test_m(m):\n    pass\n")
    (tmp_path / "test_numbers.py").write_text(
        "import pytest\npytestmark = pytest.mark.numerics\n\n"
        "@pytest.mark.parametrize('x', [1, 2, 3])\ndef test_a(x, kernels):\n    pass\n\n"
        "def test_b():\n    pass\n\n"
        "@pytest.mark.parametrize('y', [1, pytest.param(2, marks=pytest.mark.quick), 3])\n"
        "def test_q(y, kernels):\n    pass\n")
    (tmp_path / "test_checks.py").write_text(
        "import pytest\npytestmark = pytest.mark.unit\n\n"
        "@pytest.mark.parametrize('x', [1, 2])\ndef test_c(x):\n    pass\n")

    def collected(*flags):
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                              "--no-compile-cache", *flags, "."], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        return sorted(line for line in run.stdout.splitlines() if "::" in line)

    quick = collected("-m", "not slow")
    assert quick == sorted(["test_checks.py::test_c[1]", "test_checks.py::test_c[2]", "test_numbers.py::test_b",
                            "test_numbers.py::test_a[decomposed-1]", "test_numbers.py::test_a[tuned-1]",
                            "test_numbers.py::test_q[decomposed-2]", "test_numbers.py::test_q[tuned-2]",
                            "test_models.py::test_m[p]"]), quick
    whole = collected()  # every case on the floor and the kernels, each value once on the emulation
    assert len(whole) == 2 + 2 + 1 + 3 + 3 + 3 + 3 + 3 + 3, whole
