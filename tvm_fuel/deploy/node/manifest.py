"""A bundle's ``manifest.json``: its schema, read and checked in one place.

The builder writes it (``tvm_fuel.deploy.bundle``) and recognises an earlier bundle by it before
replacing that folder; ``run.py`` and its workers read it before anything runs. A manifest
that is missing, not JSON or not of this schema is a ``NodeError`` naming the file and what is
wrong, never a traceback.

Contents:
    SCHEMA, STAGES
    read_manifest -- the checked manifest of a bundle folder
    bundle_files  -- the files the builder wrote, as relative paths (the manifest's ``files``)
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

from .environment import NodeError

SCHEMA = "tvm_fuel-bundle/1"  # changes when a field that the node or the builder reads changes
STAGES = ("smoke", "check", "bench", "tune")
_BUNDLE_ID = re.compile(r"[0-9a-f]{12}")


def _problem(manifest) -> str | None:
    """What makes ``manifest`` unusable (None when it is a manifest of this schema): the fields
    that run.py, its workers and the builder read before any case runs."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    if manifest.get("schema") != SCHEMA:
        return f"schema {manifest.get('schema')!r}, not {SCHEMA!r} (built by another tvm_fuel version?)"
    if not isinstance(manifest.get("bundle_id"), str) or not _BUNDLE_ID.fullmatch(manifest["bundle_id"]):
        return f"bundle_id {manifest.get('bundle_id')!r} is not 12 hex digits"
    for key, kind in (("cases", list), ("tune_buckets", list), ("bundle", dict), ("target", dict),
                      ("runtime", dict), ("files", list)):
        if not isinstance(manifest.get(key), kind):
            return f"{key!r} is missing or not a {kind.__name__}"
    for index, case in enumerate(manifest["cases"]):
        if not isinstance(case, dict) or case.get("stage") not in STAGES or not isinstance(case.get("name"), str):
            return f"cases[{index}] has no stage of {list(STAGES)} or no name"
        if case["stage"] == "tune" and not all(key in case for key in ("bucket", "function", "knobs", "hand_picked")):
            return f"tune case {case['name']!r} lacks bucket, function, knobs or hand_picked"
    if not all(isinstance(b, dict) and isinstance(b.get("id"), str) for b in manifest["tune_buckets"]):
        return "a tune bucket has no id"
    if not isinstance(manifest["bundle"].get("target"), str) or manifest["target"].get("device") not in ("cuda", "cpu"):
        return "bundle.target or target.device is missing"
    wheels = manifest["runtime"].get("wheels")
    if not isinstance(wheels, dict) or not all(isinstance(w, str) for w in wheels.values()):
        return "runtime.wheels is missing"
    try:
        bundle_files(manifest)
    except ValueError as err:
        return str(err)
    return None


def bundle_files(manifest: dict) -> list[PurePosixPath]:
    """The manifest's ``files``: relative paths inside the bundle; ValueError for one that is
    absolute or climbs out of it (``..``), so that nothing outside the bundle is ever taken as its."""
    paths = []
    for entry in manifest["files"]:
        path = PurePosixPath(entry) if isinstance(entry, str) else None
        if path is None or path.is_absolute() or not path.parts or any(p in ("..", ".", "") for p in path.parts) \
                or str(path) != entry:
            raise ValueError(f"files entry {entry!r} is not a plain relative path inside the bundle")
        paths.append(path)
    return paths


def read_manifest(bundle: Path) -> dict:
    """``bundle / manifest.json``, checked; NodeError saying why it cannot be used."""
    path = bundle / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise NodeError(f"{bundle} holds no manifest.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise NodeError(f"{path} cannot be read as JSON ({err})") from None
    problem = _problem(manifest)
    if problem:
        raise NodeError(f"{path} is not a tvm_fuel bundle manifest: {problem}")
    return manifest
