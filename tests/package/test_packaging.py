"""The package's layout works every way it is used (issue 15).

``schedules/`` and ``tuning_logs/`` sit at the repository root; pyproject.toml's package-dir makes
them ``tvm_fuel.schedules`` / ``tvm_fuel.tuning_logs`` in a wheel and the editable finder maps them in
``pip install -e .``. Nothing else maps them (no import hook): a checkout imported without an install
(``PYTHONPATH=.``, or ``python -m tvm_fuel`` run at the root, shadowing an installed wheel) says to
install it.

Every check runs in a subprocess that cannot see an editable install of this repository: the
interpreter's own sys.path entries are handed over as plain paths (PYTHONPATH, or a ``.pth`` of
paths in a venv), so their ``.pth`` hooks, the ``__editable__`` finder among them, never run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# Where tvm_fuel, its two top-level subpackages, a deeper subpackage and the shipped logs came from.
PROBE = """
import importlib.util, json, sys
import tvm_fuel, tvm_fuel.schedules, tvm_fuel.tuning_logs, tvm_fuel.schedules.cpu.rules
from tvm_fuel.dispatch.records import shipped_logs
print(json.dumps(dict(
    package=tvm_fuel.__file__, schedules=tvm_fuel.schedules.__file__,
    cpu_rules=tvm_fuel.schedules.cpu.rules.__file__, tuning_logs=tvm_fuel.tuning_logs.__file__,
    logs=sorted(str(p.relative_to(shipped_logs())) for p in shipped_logs().rglob("*.json")),
    tests_exposed=importlib.util.find_spec("tvm_fuel.tests") is not None,
    editable_finder=any("__editable__" in getattr(f, "__module__", "") for f in sys.meta_path),
)))
"""


def _host_paths() -> list[str]:
    """This interpreter's import path without the repository (an old-style editable .pth adds it)."""
    paths = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        path = Path(entry).resolve()
        if path == REPO or REPO in path.parents:
            continue
        paths.append(str(path))
    return list(dict.fromkeys(paths))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd[:3])} ... in {cwd} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _probe(python: str, cwd: Path, env: dict[str, str], *flags: str) -> dict:
    return json.loads(_run([python, *flags, "-c", PROBE], cwd, env).stdout.strip().splitlines()[-1])


def _expected_logs() -> list[str]:
    return sorted(str(p.relative_to(REPO / "tuning_logs")) for p in (REPO / "tuning_logs").rglob("*.json")
                  if "logs" not in p.relative_to(REPO / "tuning_logs").parts[:1])  # logs/: git-ignored output


def test_editable_install_maps_the_root_folders(tmp_path):
    """``pip install -e .`` (the README's command): the editable finder maps the root's folders in."""
    found = _probe(sys.executable, tmp_path, _env())
    if not found["editable_finder"]:
        pytest.skip("tvm_fuel is not installed editable here")
    assert Path(found["package"]).resolve() == REPO / "tvm_fuel" / "__init__.py"
    assert Path(found["schedules"]).resolve() == REPO / "schedules" / "__init__.py"
    assert Path(found["cpu_rules"]).resolve() == REPO / "schedules" / "cpu" / "rules.py"
    assert Path(found["tuning_logs"]).resolve() == REPO / "tuning_logs" / "__init__.py"
    assert found["logs"] and set(_expected_logs()) <= set(found["logs"])
    assert not found["tests_exposed"], "the repository root must not become part of tvm_fuel.__path__"


def _refused_uninstalled(python: str, cwd: Path, env: dict[str, str], *flags: str) -> None:
    proc = subprocess.run([python, *flags, "-c", "import tvm_fuel"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "this checkout is not installed" in proc.stderr, proc.stdout + proc.stderr
    assert "pip install -e ." in proc.stderr


@pytest.mark.parametrize("where", ["repo root", "elsewhere"])
def test_uninstalled_checkout_says_to_install(where, tmp_path):
    """``PYTHONPATH=<checkout>`` without any install: no hook maps the root's folders in; the import
    says to install the package."""
    cwd = REPO if where == "repo root" else tmp_path
    env = _env(PYTHONPATH=os.pathsep.join([str(REPO), *_host_paths()]))
    _refused_uninstalled(sys.executable, cwd, env, "-S")  # -S: no site-packages .pth hooks (the editable finder)


def test_no_module_edits_the_import_system():
    # the package is found as installed: nothing of tvm_fuel adds a finder
    found = [str(p.relative_to(REPO)) for p in (*(REPO / "tvm_fuel").rglob("*.py"), *(REPO / "schedules").rglob("*.py"))
             if "meta_path" in p.read_text() or "path_hooks" in p.read_text()]
    assert found == []


def test_running_interpreter_is_consistent():
    """Whatever installed tvm_fuel here (editable, wheel, checkout), its subpackages come with it."""
    import tvm_fuel
    import tvm_fuel.schedules
    import tvm_fuel.tuning_logs

    package = Path(tvm_fuel.__file__).resolve().parent
    for sub in (tvm_fuel.schedules, tvm_fuel.tuning_logs):
        folder = Path(sub.__file__).resolve().parent
        assert folder.parent in (package, package.parent), (package, folder)


def _source_copy(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them (no build/, egg-info or caches), with edits."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info",
                                                                  "__pycache__", ".pytest_cache"))
        return dest
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


@pytest.mark.slow
def test_built_wheel_in_fresh_venv(tmp_path):
    """``pip wheel .``, installed into a fresh venv: the wheel holds the subpackages and the logs,
    and ``python -m tvm_fuel demo --quick`` runs."""
    src = _source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(dist)], env=_env(), capture_output=True, text=True, timeout=300)
    wheels = list(dist.glob("tvm_fuel-*.whl"))
    if built.returncode != 0 or not wheels:
        pytest.skip(f"pip wheel cannot build here (offline, no setuptools?): {(built.stdout + built.stderr)[-800:]}")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, _env())
    python = str(venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheels[0])], tmp_path, _env())
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path,
                        _env()).stdout.strip()).resolve()
    # TVM, numpy, ... from this interpreter as plain paths after the venv's own: no .pth of theirs runs,
    # so neither the editable finder nor an installed tvm_fuel here gets in front of the wheel.
    (purelib / "_host_paths.pth").write_text("\n".join(_host_paths()) + "\n")
    env = _env()

    installed = _probe(python, tmp_path, env)
    assert Path(installed["package"]).resolve() == purelib / "tvm_fuel" / "__init__.py"
    assert Path(installed["schedules"]).resolve() == purelib / "tvm_fuel" / "schedules" / "__init__.py"
    assert Path(installed["tuning_logs"]).resolve() == purelib / "tvm_fuel" / "tuning_logs" / "__init__.py"
    assert installed["logs"] and installed["logs"] == _expected_logs(), "the wheel must carry every shipped log"
    assert not installed["tests_exposed"] and not installed["editable_finder"]

    _refused_uninstalled(python, REPO, env)  # the checkout shadows the wheel: uninstalled, it says so

    for cwd in (tmp_path,):
        demo = _run([python, "-m", "tvm_fuel", "demo", "--quick"], cwd, env)
        # --quick: the ops part alone, one check per op output, each "ok"
        assert "all 10 checks hold" in demo.stdout and demo.stdout.count(" ok\n") == 10, demo.stdout[-2000:]
        assert "[decoder]" not in demo.stdout and "[training]" not in demo.stdout
