"""TVMScript's parser entries and macro expansion at the cost of a frame walk (the kernels are written
with ``T.prim_func`` and ``T.macro``).

Applies to: TVM 0.27.0. Works around: ``python/tvm/script/parser/core/parser.py``
``ScriptMacro._find_parser_def`` (``inspect.getouterframes``), and the ``inspect.stack()`` of the
parser's entries: ``python/tvm/tirx/script/parser/entry.py`` ``prim_func``,
``python/tvm/script/parser/ir/entry.py`` ``ir_module``, ``python/tvm/relax/script/parser/entry.py``
``function``. Each replacement checks it finds the code it replaces, and leaves a TVM that differs
untouched.

TVM's ``ScriptMacro._find_parser_def`` finds the active parser with
``inspect.getouterframes``, which reads every outer frame's source line and, for each, scans
``sys.modules`` for the frame's module. With PyTorch and transformers imported (thousands of
modules) that is ~0.35 s per macro call: 15 of the 17 s it took to build one CUDA forward kernel,
and most of what building the CPU kernels costs. The lookup only needs each frame's globals, so
the replacement walks ``f_back`` and returns the same parser (the innermost frame holding it).

The parser's entries (``T.prim_func``, ``I.ir_module``, ``R.function``) take ``inspect.stack()``
once per parse, for a few frames' locals and one source line. Its frame info looks up each
frame's module, and a frame of no module file (``<frozen importlib._bootstrap>``: any parse
during an import) scans all of ``sys.modules`` every time: importing
``tvm.s_tir.tensor_intrin`` (~500 prim_funcs, what every MetaSchedule ``TuneContext`` does) took
35 s inside a test with PyTorch imported, 130 s in the tuning tests. ``cheap_stack`` gives the same
frames, names, line numbers and source lines (``linecache``'s, as ``inspect`` reads them) without
the module lookups.

``install`` applies both when tvm_fuel is imported (``tvm_fuel.compat.install``), before any
kernel is parsed.

Contents:
    install           -- both replacements below (idempotent)
    fast_macro_lookup -- install the frame walk (idempotent; leaves an unfamiliar TVM untouched)
    tvms_lookup       -- TVM's own lookup as it was (None until replaced)
    fast_entry_stacks -- give the parser's entries ``cheap_stack`` (idempotent)
    cheap_stack       -- ``inspect.stack()`` without the module lookups
"""

from __future__ import annotations

import importlib
import inspect
import linecache
import sys

tvms_lookup = None


def _find_parser_def(self):
    """The parser of the innermost enclosing frame that holds one (as TVM's lookup, without frame info)."""
    from tvm.script.parser.core.parser import ScriptMacro

    frame = inspect.currentframe()
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


def fast_macro_lookup() -> bool:
    """Replace ``ScriptMacro._find_parser_def`` with the frame walk; False where TVM's lookup is not
    the one this replaces (no such method, or one that does not read the outer frames: it stays)."""
    global tvms_lookup
    from tvm.script.parser.core.parser import ScriptMacro

    current = ScriptMacro.__dict__.get("_find_parser_def")
    if current is _find_parser_def:
        return True
    code = getattr(current, "__code__", None)
    if code is None or "getouterframes" not in code.co_names or not hasattr(ScriptMacro, "parser_object_name"):
        return False
    tvms_lookup = current
    ScriptMacro._find_parser_def = _find_parser_def  # noqa: SLF001  (TVM's own lookup, replaced: see above)
    return True


def cheap_stack(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack(context)``'s frame infos from the caller outwards; ``code_context`` holds the
    frame's own line (``context`` 1, what the parser's entries take) read through ``linecache``,
    re-read where the file changed since it was cached (as inspect's ``findsource`` does)."""
    infos, checked = [], set()
    frame = sys._getframe(1)  # noqa: SLF001  (the caller's frame, as inspect.stack's first)
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        if context > 0 and filename not in checked:  # one stat per file: an edited, reloaded file's new text
            linecache.checkcache(filename)
            checked.add(filename)
        line = linecache.getline(filename, lineno, frame.f_globals) if context > 0 else ""
        infos.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, [line] if line else None,
                                       0 if line else None))
        frame = frame.f_back
    return infos


class _InspectWithCheapStack:
    """The ``inspect`` module as a parser entry sees it: ``stack`` is ``cheap_stack``, the rest inspect's."""

    stack = staticmethod(cheap_stack)

    def __getattr__(self, name):
        return getattr(inspect, name)


# the modules whose parser entries call inspect.stack() once per parse (TVM 0.27)
_ENTRY_MODULES = ("tvm.tirx.script.parser.entry", "tvm.script.parser.ir.entry", "tvm.relax.script.parser.entry")


def fast_entry_stacks() -> list[str]:
    """Give each of the parser's entry modules ``cheap_stack`` for its ``inspect.stack()``; returns the
    modules now using it (one whose ``inspect`` is not the module, or that is missing, stays as it is)."""
    patched = []
    for name in _ENTRY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, "inspect", None)
        if current is inspect:
            module.inspect = _InspectWithCheapStack()
        if isinstance(getattr(module, "inspect", None), _InspectWithCheapStack):
            patched.append(name)
    return patched


def install() -> dict[str, object]:
    """Both replacements (idempotent): whether the macro lookup is the frame walk, and the parser's
    entry modules using ``cheap_stack``."""
    return {"macro_lookup": fast_macro_lookup(), "entry_stacks": fast_entry_stacks()}


__all__ = ["install", "fast_macro_lookup", "fast_entry_stacks", "cheap_stack"]  # (tvms_lookup: read as an attribute)
