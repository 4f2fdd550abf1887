"""TVMScript's macro expansion at the cost of a frame walk (the kernels are written with ``T.macro``).

TVM 0.27's ``ScriptMacro._find_parser_def`` finds the active parser with
``inspect.getouterframes``, which reads every outer frame's source line and, for each, scans
``sys.modules`` for the frame's module. With PyTorch and transformers imported (thousands of
modules) that is ~0.35 s per macro call: 15 of the 17 s it took to build one CUDA forward kernel,
and most of what building the CPU kernels costs. The lookup only needs each frame's globals, so
the replacement walks ``f_back`` and returns the same parser (the innermost frame holding it).

Contents:
    fast_macro_lookup -- install the frame walk (idempotent; leaves an unfamiliar TVM untouched)
    tvms_lookup       -- TVM's own lookup as it was (None until replaced)
"""

from __future__ import annotations

import inspect

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
