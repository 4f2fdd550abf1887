"""The commands' output folders: checked before any work, and no file written over that tvm_fuel did not write.

Every folder a command writes into (``bench --out``, ``gpucheck --out``, ``bundle --out``,
``tune --work-dir``) is checked before anything runs: not a file, writable or creatable, and not
inside the package's own folders (its sources, ``schedules/``, the shipped ``tuning_logs/``), so a
mistyped path fails in one line instead of after a benchmark's minutes, and no run writes results
into the shipped package.

A command that writes fixed file names (``bench``: ``bench.json``, ``decoder.json``, ...) claims
them first: a name that exists is written over only where the folder's ledger (``LEDGER``) records
that the same command wrote it and the file is unchanged since. Any other file of that name (a
user's, another tool's, one edited by hand) makes the command refuse before any work, naming the
option and the file; nothing else in the folder is touched. ``bundle`` and ``gpucheck`` recognise
their own files by the bundle's manifest instead (``tvm_fuel.deploy``).

Contents:
    check_output_dir -- the path, if it is (or can be made) a writable folder outside the package
    package_folder   -- which of the package's own folders holds a path (None: none)
    OutputFiles      -- the fixed-name files one command writes into a folder: claimed, written, recorded
    LEDGER
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import uuid
from pathlib import Path

LEDGER = ".tvm_fuel-outputs.json"  # {"schema", "files": {name: {"command", "sha256"}}}
_LEDGER_SCHEMA = "tvm_fuel-outputs/1"


def _package_folders() -> dict[str, Path]:
    """The folders installed as the package, resolved: its sources and the two it maps in (by their
    import specs, so an installed wheel and a checkout's editable install are both covered)."""
    found = {"its source folder": Path(__file__).resolve().parent}
    for name, label in (("schedules", "its schedules folder"), ("tuning_logs", "its shipped tuning logs")):
        spec = importlib.util.find_spec(f"tvm_fuel.{name}")
        for location in (spec.submodule_search_locations or []) if spec else []:
            found[label] = Path(location).resolve()
    return found


def package_folder(path: str | os.PathLike) -> tuple[str, Path] | None:
    """(which, folder) where ``path`` (resolved, links followed) is one of the package's own
    folders or inside one: its source folder (tvm_fuel/), schedules/ or the shipped tuning_logs/;
    else None."""
    real = Path(path).expanduser().resolve()
    for name, folder in _package_folders().items():
        if real.is_relative_to(folder):
            return name, folder
    return None


def check_output_dir(path: str | os.PathLike, flag: str, *, who: str, allow: tuple[Path, ...] = (),
                     hint: str = "") -> Path:
    """``path`` as a Path if it is a writable folder or can be created as one (nothing is created
    here) outside the package's own folders (``allow``: folders of the package that may be
    written, e.g. the shipped logs' root for ``tune``); else ValueError ``"{who}: {flag} {path} ..."``
    saying why, with ``hint`` (default: choose another ``flag``)."""
    path = Path(path).expanduser()
    hint = hint or f"choose another {flag}"
    # os.path's tests: False rather than PermissionError where a parent cannot be searched
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{who}: {flag} {path} is a file; give a folder ({hint})")
    inside = package_folder(path)
    if inside and path.resolve() not in {Path(folder).resolve() for folder in allow}:
        name, folder = inside
        raise ValueError(f"{who}: {flag} {path} is inside tvm_fuel's installed package ({name}, {folder}); give a "
                         f"folder outside the package")
    existing = path
    while not os.path.exists(existing) and existing != existing.parent:  # the folder mkdir will write in
        existing = existing.parent
    if not os.path.isdir(existing):
        raise ValueError(f"{who}: {flag} {path} cannot be created: {existing} is a file ({hint})")
    if not os.access(existing, os.W_OK | os.X_OK):  # also a read-only file system, even for root
        state = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise ValueError(f"{who}: {flag} {path} {state} ({hint})")
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class OutputFiles:
    """The files ``command`` writes into ``folder`` by fixed ``names`` (given as ``flag``).

    ``claim`` runs before any work: the folder is checked (``check_output_dir``) and each name
    that exists must be recorded in the folder's ledger as written by this command and unchanged
    since, else ValueError naming the flag and the file. ``write_text`` writes one of them (checked
    again: the run took minutes) and ``record`` notes files the command's library functions wrote,
    so that its next run may write over them, and over nothing else."""

    def __init__(self, folder: str | os.PathLike, names, *, command: str, flag: str = "--out"):
        self.folder, self.names, self.command, self.flag = Path(folder).expanduser(), list(names), command, flag
        self.who = f"tvm_fuel {command}"

    def claim(self) -> None:
        """Refuse, before any work, a folder the command cannot write or a file of its names it did not write."""
        check_output_dir(self.folder, self.flag, who=self.who)
        ledger = self._ledger()
        for name in self.names:
            self._check(name, ledger)

    def write_text(self, name: str, text: str) -> Path:
        """Write ``name`` whole (a temporary file renamed over it) and record it."""
        self._check(name, self._ledger())
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / name
        temporary = self.folder / f".{name}.{uuid.uuid4().hex[:8]}.tmp"  # a fresh name: never someone's file
        temporary.write_text(text)
        os.replace(temporary, path)
        self.record([name])
        return path

    def record(self, names) -> None:
        """Note in the ledger that this command wrote ``names`` (those that exist as files)."""
        ledger = self._ledger()
        for name in names:
            path = self.folder / name
            if path.is_file() and not path.is_symlink():
                ledger[name] = {"command": self.command, "sha256": _sha256(path)}
        temporary = self.folder / f".{LEDGER}.{uuid.uuid4().hex[:8]}.tmp"
        temporary.write_text(json.dumps({"schema": _LEDGER_SCHEMA, "files": ledger}, indent=1, sort_keys=True))
        os.replace(temporary, self.folder / LEDGER)

    def _refuse(self, name: str, why: str) -> ValueError:
        return ValueError(f"{self.who}: {self.flag} {self.folder} holds {name}, {why}; choose another {self.flag} "
                          f"or move {name} out of it")

    def _ledger(self) -> dict:
        """The ledger's files ({} where the folder has none); ValueError where ``LEDGER`` is not one."""
        path = self.folder / LEDGER
        if not path.exists() and not path.is_symlink():
            return {}
        try:
            ledger = json.loads(path.read_text()) if path.is_file() and not path.is_symlink() else None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            ledger = None
        if not (isinstance(ledger, dict) and ledger.get("schema") == _LEDGER_SCHEMA
                and isinstance(ledger.get("files"), dict)):
            raise self._refuse(LEDGER, "which is not tvm_fuel's record of the files it wrote there")
        return ledger["files"]

    def _check(self, name: str, ledger: dict) -> None:
        path = self.folder / name
        if not path.exists() and not path.is_symlink():
            return
        entry = ledger.get(name)
        if path.is_symlink() or not path.is_file():
            raise self._refuse(name, "which is not a plain file")
        if not isinstance(entry, dict):
            raise self._refuse(name, f"which {self.who} did not write")
        if entry.get("command") != self.command:
            raise self._refuse(name, f"which tvm_fuel {entry.get('command')} wrote, not {self.command}")
        if entry.get("sha256") != _sha256(path):
            raise self._refuse(name, f"which was changed since {self.who} wrote it")


__all__ = ["check_output_dir", "package_folder", "OutputFiles", "LEDGER"]
