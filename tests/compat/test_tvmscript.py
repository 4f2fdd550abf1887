"""The TVMScript macro lookup and parser entries the kernels are parsed with (``tvm_fuel.compat.tvmscript``)."""

from __future__ import annotations

import inspect

import pytest
import tvm
from tvm.script import tirx as T
from tvm.script.parser.core.parser import ScriptMacro

from tvm_fuel.compat import tvmscript

pytestmark = pytest.mark.unit


@T.macro
def _scaled(buf, i, factor):
    buf[i] = buf[i] * T.float32(factor)


@T.macro
def _scaled_twice(buf, i):
    _scaled(buf, i, 2.0)  # a macro calling a macro: the lookup runs from inside the parser's expansion
    _scaled(buf, i, 3.0)


def _parse():
    @T.prim_func(private=True)
    def func(a: T.Buffer((8,), "float32")):
        for i in range(8):
            _scaled_twice(a, i)

    return func


def test_the_frame_walk_parses_as_tvms_lookup_does(monkeypatch):
    """Nested macros give the same PrimFunc through TVM's own lookup and the frame walk, and the
    walk never builds frame info (what made each macro call cost ~0.35 s with PyTorch imported)."""
    assert tvmscript.fast_macro_lookup()
    assert ScriptMacro._find_parser_def is tvmscript._find_parser_def  # noqa: SLF001
    lookups, frame_reads = [], []

    def spied_lookup(self):
        lookups.append(True)
        return tvmscript._find_parser_def(self)  # noqa: SLF001

    real = inspect.getouterframes
    monkeypatch.setattr(ScriptMacro, "_find_parser_def", spied_lookup)
    monkeypatch.setattr(inspect, "getouterframes", lambda *a, **k: frame_reads.append(len(lookups)) or real(*a, **k))
    walked = _parse()
    assert len(lookups) == 3  # _scaled_twice once, _scaled twice
    assert set(frame_reads) <= {0}, "a macro lookup read the outer frames"  # (T.prim_func reads cheap_stack)
    reads_outside_lookups = len(frame_reads)

    # TVM's own lookup, for one parse, reads the outer frames at each macro call and finds the same parser
    from tvm.script.parser.core import parser as core

    frame_reads.clear()
    monkeypatch.setattr(core.ScriptMacro, "_find_parser_def", tvmscript.tvms_lookup)
    by_tvm = _parse()
    assert len(frame_reads) == reads_outside_lookups + 3  # and one per macro call
    tvm.ir.assert_structural_equal(walked, by_tvm)


def test_no_parser_outside_a_prim_func_is_an_error():
    with pytest.raises(RuntimeError, match="not available"):
        tvmscript._find_parser_def(None)  # noqa: SLF001


def _both_stacks():
    return tvmscript.cheap_stack(), inspect.stack()  # one line: both see the same frames at the same lines


def test_the_cheap_stack_reads_what_inspects_does():
    """Frame by frame: the frame, file, line, function and source line the parser's entries read,
    including a frame without source (exec'd code: no line, as inspect gives)."""
    scope = {"both": _both_stacks}
    exec("found = both()", scope)  # noqa: S102
    ours, theirs = scope["found"]
    assert len(ours) == len(theirs) > 3
    fields = ("frame", "filename", "lineno", "function", "code_context", "index")
    for mine, inspects in zip(ours, theirs):
        assert [getattr(mine, f) for f in fields] == [getattr(inspects, f) for f in fields]
    assert ours[1].filename == "<string>" and ours[1].code_context is None


def test_the_cheap_stack_reads_a_changed_file_anew(tmp_path):
    """A file edited after its lines were cached (autoreload, importlib.reload) gives its new line,
    as inspect.stack does: the parser's entries read the decorator's line from it."""
    import importlib.util

    path = tmp_path / "edited_module.py"
    header = "from tvm_fuel.compat import tvmscript\ndef where():\n"
    path.write_text(header + "    return tvmscript.cheap_stack()  # old\n")
    spec = importlib.util.spec_from_file_location("edited_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.where()[0].code_context == ["    return tvmscript.cheap_stack()  # old\n"]
    path.write_text(header + "    return tvmscript.cheap_stack()  # edited!\n")
    new_line = ["    return tvmscript.cheap_stack()  # edited!\n"]
    assert module.where()[0].code_context == new_line == inspect.getframeinfo(module.where()[0].frame).code_context


def test_parser_entries_parse_as_before_without_module_lookups(monkeypatch):
    """``T.prim_func`` through the cheap stack gives TVM's PrimFunc, and its parse no longer looks up
    each outer frame's module (what cost 35-130 s importing tvm.s_tir.tensor_intrin in a test)."""
    from tvm.tirx.script.parser import entry

    assert "tvm.tirx.script.parser.entry" in tvmscript.fast_entry_stacks()
    assert isinstance(entry.inspect, tvmscript._InspectWithCheapStack)  # noqa: SLF001
    lookups = []
    real = inspect.getmodule
    monkeypatch.setattr(inspect, "getmodule", lambda *a, **k: lookups.append(a) or real(*a, **k))
    cheap = _parse()
    cheap_lookups = len(lookups)

    lookups.clear()
    monkeypatch.setattr(entry, "inspect", inspect)  # TVM's own entry
    by_tvm = _parse()
    assert len(lookups) > cheap_lookups + 10, (len(lookups), cheap_lookups)  # one per outer frame
    tvm.ir.assert_structural_equal(cheap, by_tvm)


def _scaled_by(factor):
    """A kernel generator as the schedules write them: a macro defined inside, a closure value."""

    @T.macro
    def scale(buf, i):
        buf[i] = buf[i] * T.float32(factor)

    @T.prim_func(private=True)
    def func(a: T.Buffer((8,), "float32")):
        for i in range(8):
            scale(a, i)

    return func


def test_sources_read_and_parsed_once_give_tvms_prim_funcs(monkeypatch):
    """Built again (another closure value), a generator's kernel reads no source and parses no text:
    it walks the doc trees of the first build, and equals what TVM's own ``Source`` parses."""
    from tvm.script.parser.core import diagnostics, doc

    assert tvmscript.shared_sources()
    _scaled_by(2.0)
    reads, parses = [], []
    real_lines, real_parse = diagnostics.getsourcelines, doc.parse
    monkeypatch.setattr(diagnostics, "getsourcelines", lambda *a: reads.append(a) or real_lines(*a))
    monkeypatch.setattr(doc, "parse", lambda *a, **k: parses.append(a) or real_parse(*a, **k))
    shared = [_scaled_by(factor) for factor in (3.0, 3.0, 5.0)]
    assert not reads and not parses
    tvm.ir.assert_structural_equal(shared[0], shared[1])

    monkeypatch.setattr(diagnostics.Source, "__init__", tvmscript.tvms_source[0])
    monkeypatch.setattr(diagnostics.Source, "as_ast", tvmscript.tvms_source[1])
    for factor, func in zip((3.0, 5.0), shared[1:]):
        tvm.ir.assert_structural_equal(func, _scaled_by(factor))
    assert reads and parses  # (TVM's own Source reads and parses every time)
    assert shared[0].script() != shared[2].script()  # the closure's value, not the first build's


def _sliced(lower, upper):
    """A slice without a step in an assignment: the parser writes a step of 1 into the tree before it reads it."""

    @T.prim_func(private=True, check_well_formed=False)
    def func(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
        with T.sblock("copy"):
            window = a[lower:upper]
            T.reads(window)
            T.writes(b[0])
            b[0] = a[lower] + a[upper - 1]

    return func


def _scaled_inline(scale):
    """A ``T.inline`` defined in the function: the parser pops its decorator and moves its position in the tree."""

    @T.prim_func(private=True)
    def func(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
        @T.inline
        def scaled(i):
            b[i] = a[i] * T.float32(scale)

        for i in range(8):
            scaled(i)

    return func


def test_only_trees_the_parser_leaves_as_they_read_are_shared(monkeypatch):
    """A tree whose omitted slice step the parser filled reads as before (shared: the same PrimFuncs
    as TVM's own parse); a tree defining a function inside its function (a ``T.inline``, rewritten by
    the parser) is parsed anew at each build."""
    from tvm.script.parser.core import diagnostics

    assert tvmscript.shared_sources()
    shared = [(_sliced, 1, 5), (_sliced, 2, 6), (_scaled_inline, 2.0), (_scaled_inline, 3.0)]
    built = [make(*args) for make, *args in shared]
    trees = {text: tree for text, tree in tvmscript.shared_trees().items() if "b[0] = a[lower]" in text}
    (tree,) = trees.values()
    from tvm.script.parser.core import doc

    slices = [node for node, _ in tvmscript.doc_nodes(tree) if isinstance(node, doc.Slice)]
    assert [s.step.value for s in slices] == [1]  # written by the first build, read by the second
    assert not any("@T.inline" in text for text in tvmscript.shared_trees())  # (the function holding it)

    monkeypatch.setattr(diagnostics.Source, "__init__", tvmscript.tvms_source[0])
    monkeypatch.setattr(diagnostics.Source, "as_ast", tvmscript.tvms_source[1])
    for func, (make, *args) in zip(built, shared):
        by_tvm = make(*args)
        tvm.ir.assert_structural_equal(func, by_tvm)
        assert func.script() == by_tvm.script()


def test_a_shared_tree_with_an_inline_would_not_parse_again(monkeypatch):
    """Why such trees are parsed anew: the first parse pops the ``T.inline``'s decorator from the tree."""
    from tvm.script.parser.core import diagnostics

    assert tvmscript.shared_sources()
    monkeypatch.setattr(tvmscript, "_nests_a_function", lambda tree: False)
    tvmscript.shared_trees()  # (this thread's trees exist, to be set aside for the test)
    monkeypatch.setattr(tvmscript._per_thread, "trees", {})  # noqa: SLF001
    _scaled_inline(4.0)
    with pytest.raises(diagnostics.DiagnosticError, match="must be decorated"):
        _scaled_inline(5.0)


def test_equal_functions_of_two_files_and_two_wrapped_macros_keep_their_own_sources(tmp_path):
    """Code objects compare equal across files (annotations are not part of them), and every
    ``functools.wraps`` wrapper of one decorator has the same code: each place keeps its own source."""
    import functools
    import importlib.util

    assert tvmscript.shared_sources()
    built = []
    for size in (128, 256):
        path = tmp_path / f"kernel_{size}.py"
        path.write_text(f"from tvm.script import tirx as T\nN = {size}\n\n\ndef build():\n"
                        "    @T.prim_func(private=True)\n    def main(a: T.Buffer((N,), \"float32\")):\n"
                        "        a[0] = T.float32(1)\n\n    return main\n")
        spec = importlib.util.spec_from_file_location(f"kernel_{size}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        built.append(module.build())
    assert "T.Buffer((128,)" in built[0].script() and "T.Buffer((256,)" in built[1].script()

    def logged(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            return function(*args, **kwargs)

        return wrapper

    def plus_one(buf, i):
        buf[i] = buf[i] + T.float32(1)

    def times_two(buf, i):
        buf[i] = buf[i] * T.float32(2)

    first, second = T.macro(logged(plus_one)), T.macro(logged(times_two))

    @T.prim_func(private=True)
    def both(a: T.Buffer((8,), "float32")):
        for i in range(8):
            first(a, i)
            second(a, i)

    assert "+ T.float32(1.0)" in both.script() and "* T.float32(2.0)" in both.script()
