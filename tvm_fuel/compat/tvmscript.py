"""TVMScript's parser entries and macro expansion at the cost of a frame walk, and each source read and
parsed once (the kernels are written with ``T.prim_func`` and ``T.macro``).

Applies to: TVM 0.27.0. Works around: ``python/tvm/script/parser/core/parser.py``
``ScriptMacro._find_parser_def`` (``inspect.getouterframes``), and the ``inspect.stack()`` of the
parser's entries: ``python/tvm/tirx/script/parser/entry.py`` ``prim_func``,
``python/tvm/script/parser/ir/entry.py`` ``ir_module``, ``python/tvm/relax/script/parser/entry.py``
``function``; ``python/tvm/script/parser/core/diagnostics.py`` ``Source``. Each replacement checks
it finds the code it replaces, and leaves a TVM that differs untouched.

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

The parser reads and parses a function's source anew each time (``python/tvm/script/parser/core/
diagnostics.py`` ``Source.__init__`` and ``Source.as_ast``). A kernel generator defines its
``T.macro``s inside itself, so every kernel built reads each macro's source (``inspect``: the
block's lines and its module's whole text) and converts each macro's source to TVMScript's doc
tree again at every use: a third of building a kernel (36 CPU and emulated CUDA forward kernels,
5.8-6.4 s; 3.2-3.6 s with both read once). ``shared_sources`` keeps a function's ``Source`` per
place (its code object and the one it wraps, by identity: equal code objects of two files are two
places) and, per thread, the doc tree of each function's source text, which every parse of that
text then walks. A tree is shared only where a second parse reads what the first did: TVM's parser
writes into a tree in three places. An omitted slice step it fills with 1 (``evaluator.py``
``_visit_node``, ``tirx/script/parser/parser.py`` ``visit_assign``) before it reads the slice, so a
filled step reads the same; an augmented assignment's target it flips to load and back to store
(``visit_aug_assign``), so a tree is never walked by two threads at once; and a ``T.inline``
definition loses its decorator and moves (``visit_inline_function_def``), so a tree with a function
defined inside its function is parsed anew each time.

``install`` applies all three when tvm_fuel is imported (``tvm_fuel.compat.install``), before any
kernel is parsed.

Contents:
    install           -- the replacements below (idempotent)
    fast_macro_lookup -- install the frame walk (idempotent; leaves an unfamiliar TVM untouched)
    tvms_lookup       -- TVM's own lookup as it was (None until replaced)
    fast_entry_stacks -- give the parser's entries ``cheap_stack`` (idempotent)
    cheap_stack       -- ``inspect.stack()`` without the module lookups
    shared_sources    -- read a function's source and parse its text once (idempotent)
    shared_trees      -- this thread's shared doc trees, by source text
    doc_nodes         -- a doc tree's nodes, each with the number of functions around it
    tvms_source       -- TVM's own ``Source.__init__`` and ``Source.as_ast`` as they were (None until replaced)
"""

from __future__ import annotations

import importlib
import inspect
import linecache
import sys
import threading

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


tvms_source = None
_SOURCE_FIELDS = ("source_name", "start_line", "start_column", "source", "full_source")
# a place's key (ids of its two codes, its module name) -> (the place, which keeps both codes and so
# their ids alive, and its Source's fields); equal code objects of two places are two keys
_sources: dict[tuple, tuple] = {}
_texts: dict[str, str] = {}  # one copy of each module's text, however many functions of it are kept
_per_thread = threading.local()  # .trees: a source text -> its doc tree, walked by every parse of it


def _place(program) -> tuple | None:
    """What a function's ``Source`` depends on: the code of the program itself (its file), the code
    read (``getsourcelines`` unwraps it) and its module name (the module text read); None for a
    program that is no function (a class, a string)."""
    code = getattr(program, "__code__", None)
    if code is None:
        return None
    try:
        inner = getattr(inspect.unwrap(program), "__code__", None)
    except ValueError:  # a cycle of __wrapped__: TVM's own Source reports it
        return None
    return None if inner is None else (code, inner, getattr(program, "__module__", None))


def _source_init(self, program):
    """TVM's ``Source.__init__``, a function's lines and module text read once per place in a file."""
    place = _place(program)
    key = None if place is None else (id(place[0]), id(place[1]), place[2])
    known = _sources.get(key)  # (never a None key: a program that is no function is not kept)
    if known is None:
        tvms_source[0](self, program)
        if place is not None:
            self.full_source = _texts.setdefault(self.full_source, self.full_source)
            _sources[key] = (place, tuple(getattr(self, field) for field in _SOURCE_FIELDS))
    else:
        for field, value in zip(_SOURCE_FIELDS, known[1]):
            setattr(self, field, value)
    self.of_function = place is not None  # (a string's text is parsed as TVM parses it: anew)


def doc_nodes(tree, functions: int = 0):
    """Every doc node of ``tree`` with the number of function definitions around it (itself not counted)."""
    from tvm.script.parser.core import doc

    if isinstance(tree, (list, tuple)):
        for child in tree:
            yield from doc_nodes(child, functions)
    elif isinstance(tree, doc.AST):
        yield tree, functions
        inner = functions + isinstance(tree, doc.FunctionDef)
        for field in type(tree)._FIELDS:  # noqa: SLF001
            yield from doc_nodes(getattr(tree, field, None), inner)


def _nests_a_function(tree) -> bool:
    """Whether a function is defined inside one of ``tree``'s functions (a ``T.inline``, which the
    parser rewrites in place)."""
    from tvm.script.parser.core import doc

    return any(functions and isinstance(node, doc.FunctionDef) for node, functions in doc_nodes(tree))


def shared_trees() -> dict:
    """This thread's shared doc trees, by source text."""
    trees = getattr(_per_thread, "trees", None)
    if trees is None:
        trees = _per_thread.trees = {}
    return trees


def _shared_tree(self):
    """TVM's ``Source.as_ast``, one doc tree per function's source text and thread (where a second
    parse reads what the first did; a parse flips an augmented assignment's target between load and
    store, so two threads never walk one tree)."""
    if not getattr(self, "of_function", False):
        return tvms_source[1](self)
    trees = shared_trees()
    tree = trees.get(self.source)
    if tree is None:
        tree = tvms_source[1](self)
        if not _nests_a_function(tree):
            trees[self.source] = tree
    return tree


def shared_sources() -> bool:
    """Replace ``Source.__init__`` and ``Source.as_ast`` with the once-per-function read and the
    once-per-text parse; False where TVM's are not the ones these replace (both stay)."""
    global tvms_source
    from tvm.script.parser.core.diagnostics import Source

    init, as_ast = Source.__dict__.get("__init__"), Source.__dict__.get("as_ast")
    if init is _source_init and as_ast is _shared_tree:
        return True
    init_names = getattr(getattr(init, "__code__", None), "co_names", ())
    as_ast_names = getattr(getattr(as_ast, "__code__", None), "co_names", ())
    if "getsourcelines" not in init_names or "parse" not in as_ast_names:
        return False
    tvms_source = (init, as_ast)
    Source.__init__, Source.as_ast = _source_init, _shared_tree
    return True


def install() -> dict[str, object]:
    """The replacements (idempotent): whether the macro lookup is the frame walk, the parser's entry
    modules using ``cheap_stack``, and whether sources are read and parsed once."""
    return {"macro_lookup": fast_macro_lookup(), "entry_stacks": fast_entry_stacks(),
            "shared_sources": shared_sources()}


__all__ = ["install", "fast_macro_lookup", "fast_entry_stacks", "cheap_stack",
           "shared_sources", "shared_trees", "doc_nodes"]  # (tvms_lookup, tvms_source: read as attributes)
