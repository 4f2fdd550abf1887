"""Fixtures shared by the test modules, and the tiers every test module declares.

Tests live by subject (``op/``, ``schedules/``, ``dispatch/``, ``transform/``, ``autodiff/``,
``tuning/``, ``deploy/``, ``models/``, ``reference/``, ``compat/``, ``package/``). Each module
declares its tier itself, in its ``pytestmark``: ``unit`` (checks and parsing, no kernel), ``numerics`` (ops against the
reference on every path) or ``integration`` (Relax passes, models, tuning, CLI, bundles), and
``slow`` where ``pytest -m "not slow"`` should leave it out to run in a few minutes (the modules
that tune or build bundles or models, the CUDA kernels' nvcc builds). A module without exactly one
tier stops the collection. The CUDA kernels' llvm emulation (the ``cuda-emulated`` parameter of
the ``kernels`` fixture) is slow wherever it runs; ``gpu`` needs a device.

The quick run takes each ``numerics`` and ``integration`` test function once per path (its first
parameter case on the floor, on the kernels, or the case marked ``quick``): every check runs on
every path but a few left to the whole suite by a ``slow`` mark; the whole suite runs every case
(``quick_cases``).
"""

from __future__ import annotations

import pytest

TIERS = ("unit", "numerics", "integration")


def module_tier(module) -> str:
    """The one tier ``module`` declares in its ``pytestmark``; UsageError naming the file otherwise."""
    marks = getattr(module, "pytestmark", [])
    marks = marks if isinstance(marks, (list, tuple)) else [marks]
    tiers = [mark.name for mark in marks if getattr(mark, "name", None) in TIERS]
    if len(tiers) != 1:
        raise pytest.UsageError(
            f"{getattr(module, '__file__', module)}: declare exactly one tier of {TIERS} in the module's "
            f"pytestmark (e.g. pytestmark = pytest.mark.numerics); found {tiers or 'none'}")
    return tiers[0]


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every collected module is checked
def pytest_collection_modifyitems(config, items):
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        module_tier(module)
    for item in items:
        if "cuda-emulated" in item.nodeid:
            item.add_marker(pytest.mark.slow)
    for item in set(items) - quick_cases(items):
        item.add_marker(pytest.mark.slow)
    if not config.getoption("full_emulation"):
        dropped = _beyond_each_choice([item for item in items if "cuda-emulated" in item.nodeid])
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if item not in dropped]


def pytest_configure(config):
    if config.getoption("numprocesses", default=None) and not hasattr(config, "workerinput"):
        return  # xdist's controller runs no test (and TVM's import takes 3 s before the workers start)
    if not config.getoption("no_compile_cache"):
        import tvm
        from compile_cache import CompileCache

        tvm.compile = CompileCache(tvm.compile)
    report = config.getoption("compile_report")
    if report:  # around the cache: a hit is timed too
        import os

        from compile_clock import CompileClock

        CompileClock(f"{report}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}").install()


def pytest_addoption(parser):
    parser.addoption("--no-compile-cache", action="store_true", default=False,
                     help="compile every module anew (default: a module compiled again in the same worker reuses "
                          "its executable: tests/compile_cache.py)")
    parser.addoption("--compile-report", metavar="FILE", default=None,
                     help="write each test's seconds in tvm.compile and in creating its VMs (LLVM's JIT) to "
                          "FILE.<worker>; python tests/compile_clock.py FILE.* --junit XML sums them")
    parser.addoption("--full-emulation", action="store_true", default=False,
                     help="run every parameter combination of the CUDA kernels' llvm emulation (default: each "
                          "parameter value of a test at least once on it)")


def quick_cases(items) -> set:
    """The items a quick run keeps: every item of a ``unit`` module, and of each ``numerics`` or
    ``integration`` test function one case not marked slow on each path (the ``kernels`` or
    ``path`` parameter: floor, kernels), so every check runs on every path: the case marked
    ``quick`` (``pytest.param(..., marks=pytest.mark.quick)``, where the first is far costlier than
    another that runs the same check), else the first in collection order. A case is ~1.5 s (a
    module legalized, compiled and JIT-linked; an exported model ~8 s): the whole matrix, run by
    the whole suite, took 34 of a quick run's 37 worker-minutes, and the Hugging Face models and
    exported programs beyond their first case another 3."""
    chosen: dict[tuple, object] = {}
    kept = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or module_tier(module) == "unit":
            kept.add(item)
            continue
        if item.get_closest_marker("slow") is not None:
            continue  # left out already: the function's quick case is another
        params = getattr(getattr(item, "callspec", None), "params", {})
        path = repr(params.get("kernels", params.get("path")))  # (some modules name the fixture path)
        key = (module.__name__, getattr(item, "originalname", item.name), path)
        if key not in chosen or (item.get_closest_marker("quick") is not None
                                 and chosen[key].get_closest_marker("quick") is None):
            chosen[key] = item
    return kept | set(chosen.values())


def _beyond_each_choice(items) -> set:
    """The emulated items a test function does not need for each of its parameters' values to run
    at least once on the emulation (collection order decides which combination carries a value).
    The CPU kernels and the floor run every combination; the emulation is one thread, ~1/7 of the
    suite's time over the whole matrix."""
    covered: dict[tuple, set] = {}
    dropped = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        seen = covered.setdefault((item.module.__name__, item.originalname), set())
        values = {(name, repr(value)) for name, value in callspec.params.items() if name != "kernels"}
        if values and values <= seen:
            dropped.add(item)
        seen |= values
    return dropped


@pytest.fixture(scope="module", params=["decomposed", "tuned", "cuda-emulated"])
def kernels(request) -> str:
    """Both halves of every op: the TE decomposition (floor) and the performance-path kernels,
    the CPU ones and the CUDA ones (their one-thread emulation on llvm: no GPU is needed)."""
    return request.param
