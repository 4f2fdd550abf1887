"""Misuse gets one clear line, not a traceback (issue 14).

The command line answers with argparse's ``error:`` line naming the option (exit 2); the Python
API raises ValueError or TypeError naming the op or class and the argument. Integer arguments
take numpy integers and refuse bools everywhere. ``tune`` writes to a per-user directory unless
told (never the shipped logs)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import HOST
import tvm
from tvm import relax, tirx

import tvm_fuel
from tvm_fuel import nn as fuel_nn
from tvm_fuel import op
from tvm_fuel.cli import build_parser, main
from tvm_fuel.op.config import AttnConfig
from tvm_fuel.kv_cache import PagedKVCache
from tvm_fuel.tuning import shipped_logs
from tvm_fuel.tuning.buckets import bucket_module
from tvm_fuel.tuning.kernels import default_work_dir, tune

pytestmark = pytest.mark.unit

DENSE = "B=1,H=2,S=16,D=16"
PAGED = "B=1,Hq=2,Hkv=2,D=16,block_size=16,ctx=32"


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of ``python -m tvm_fuel argv``, run in this process."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a directory\n")
    return path


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch) -> Path:
    """A directory this process cannot write (root ignores the mode bits, so os.access says so)."""
    path = tmp_path / "read_only"
    path.mkdir()
    path.chmod(0o555)
    if os.geteuid() == 0:
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == path else real_access(p, mode))
    yield path
    path.chmod(0o755)


# (argv, what the error names); "{file}" / "{ro}" become a file / a read-only directory
FLASH = ["tune", "--op", "flash_attn", "--shapes"]
CLI_MISUSE = {
    "work-dir is a file": (["tune", "--op", "paged_attn", "--work-dir", "{file}"], ["--work-dir", "is a file"]),
    "work-dir under a file": (["tune", "--op", "paged_attn", "--work-dir", "{file}/logs"],
                              ["--work-dir", "is a file"]),
    "work-dir read-only": (["tune", "--op", "paged_attn", "--work-dir", "{ro}/logs"],
                           ["--work-dir", "not writable"]),
    "import into read-only": (["tune", "--import", "results.json", "--work-dir", "{ro}"],
                              ["--work-dir", "not writable"]),
    "shapes dtype": ([*FLASH, DENSE + ",dtype=int8"], ["--shapes", "dtype", "float32"]),
    "shapes window": ([*FLASH, DENSE + ",window=a:b"], ["--shapes", "window", "L:R"]),
    "shapes huge window": ([*FLASH, DENSE + ",window=1:99999999999"], ["--shapes", "window", "2**31 - 1"]),
    "shapes softcap": ([*FLASH, DENSE + ",softcap=abc"], ["--shapes", "softcap"]),
    "shapes softcap overflow": ([*FLASH, DENSE + ",softcap=1e39"], ["--shapes", "softcap", "float32"]),
    "shapes causal": ([*FLASH, DENSE + ",causal=2"], ["--shapes", "causal", "0 or 1"]),
    "shapes block_size": (["tune", "--op", "paged_attn", "--shapes", PAGED.replace("block_size=16", "block_size=0")],
                          ["--shapes", "block_size", "[1, 2**31 - 1]"]),
    "shapes repeated key": (["logs", "--op", "flash_attn", "--shapes", DENSE + ",H=4"],
                            ["--shapes", "H is given twice"]),
    "trials per round": (["tune", "--op", "paged_attn", "--trials-per-iter", "0"], ["--trials-per-iter", ">= 1"]),
    "logs module missing": (["logs", "--module", "missing.py"], ["--module", "missing.py"]),
    "logs module not tvmscript": (["logs", "--no-shipped", "--module", "{file}"], ["--module", "TVMScript"]),
    "logs database file": (["logs", "--database", "{file}"], ["--database", "is a file"]),
    "models row": (["bench", "--models", "512:float32"], ["--models", "SEQxBATCH:DTYPE"]),
    "models dtype": (["bench", "--models", "512x1:int8"], ["--models", "float32 or bfloat16"]),
}


@pytest.mark.parametrize("case", CLI_MISUSE, ids=list(CLI_MISUSE))
def test_cli_misuse_is_one_error_line(case, a_file, read_only_dir, capsys):
    argv, named = CLI_MISUSE[case]
    argv = [a.replace("{file}", str(a_file)).replace("{ro}", str(read_only_dir)) for a in argv]
    code, err = _cli(argv, capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]  # argparse prints the usage first
    assert last.startswith(f"python -m tvm_fuel {argv[0]}: error: "), err
    for word in named:
        assert word in last, last
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,named", [
    ([*FLASH, DENSE + ",dtype=int8"], "dtype"),
    (["logs", "--module", "missing.py"], "--module"),
])
def test_cli_process_exits_without_traceback(argv, named, tmp_path):
    """The real process: exit 2, argparse's error line, no traceback (also run in a directory it cannot harm)."""
    done = subprocess.run([sys.executable, "-m", "tvm_fuel", *argv], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 2
    assert "error:" in done.stderr and named in done.stderr and "Traceback" not in done.stderr


# (options, error type, what the message names)
CONFIG_MISUSE = {
    "scale overflows float32": (dict(softmax_scale=1e39), ValueError, "softmax_scale must be finite and non-zero"),
    "scale underflows float32": (dict(softmax_scale=1e-50), ValueError, "softmax_scale must be finite and non-zero"),
    "softcap overflows float32": (dict(softcap=1e39), ValueError, "softcap must be finite"),
    "window too wide": (dict(window_size=(2**70, -1)), ValueError, r"window_size left must be at most 2\*\*31 - 1"),
    "window right too wide": (dict(window_size=(-1, 2**31)), ValueError, r"window_size right must be at most"),
    "causal int": (dict(causal=2), TypeError, "causal must be a bool"),
    "causal one": (dict(causal=1), TypeError, "causal must be a bool"),
    "window bool": (dict(window_size=(True, -1)), TypeError, "window_size left must be an int, not a bool"),
    "window numpy bool": (dict(window_size=(0, np.False_)), TypeError, "window_size right must be an int, not a bool"),
    "window float": (dict(window_size=(2.0, -1)), TypeError, "window_size left must be an int"),
    "scale bool": (dict(softmax_scale=True), TypeError, "softmax_scale must be a float"),
}


def _qkv():
    t = relax.TensorType((1, 2, 16, 16), "float32")
    return relax.Var("q", t), relax.Var("k", t), relax.Var("v", t)


@pytest.mark.parametrize("case", CONFIG_MISUSE, ids=list(CONFIG_MISUSE))
def test_attention_options_refused_by_name(case):
    options, error, message = CONFIG_MISUSE[case]
    with pytest.raises(error, match=rf"^fuel\.flash_attn: {message}"):
        op.flash_attn(*_qkv(), **options)
    with pytest.raises(error, match=rf"^tvm_fuel\.nn\.FlashAttention: {message}"):
        fuel_nn.FlashAttention(**options)


def test_numpy_scalars_are_accepted_as_options():
    cfg = AttnConfig.create("fuel.flash_attn", softmax_scale=np.float32(0.5), causal=np.True_,
                            window_size=(np.int64(7), np.int32(-1)), softcap=np.float64(30.0))
    assert cfg == AttnConfig(0.5, True, (7, -1), 30.0)
    assert all(type(side) is int for side in cfg.window_size)  # stored as attributes: plain ints
    assert AttnConfig.create("x", window_size=(2**31 - 1, 0)).window_size == (2**31 - 1, 0)  # the bound itself
    call = op.flash_attn(*_qkv(), causal=np.bool_(True), return_lse=np.True_)
    assert bool(call.attrs["causal"]) and bool(call.attrs["return_lse"])
    t = relax.TensorType((2, 3), "float32")
    assert int(op.softmax_backward(relax.Var("p", t), relax.Var("d", t), axis=np.int64(-1)).attrs["axis"]) == -1


@pytest.mark.parametrize("make,error,message", [
    (lambda: op.flash_attn(*_qkv(), return_lse=2), TypeError, r"fuel\.flash_attn: return_lse must be a bool"),
    (lambda: op.softmax_backward(*_qkv()[:2], axis=True), TypeError, r"fuel\.softmax_backward: axis must be an int, "
                                                                      r"not a bool"),
    (lambda: op.softmax_backward(*_qkv()[:2], axis=1.0), TypeError, r"fuel\.softmax_backward: axis must be an int"),
], ids=["return_lse int", "axis bool", "axis float"])
def test_op_constructor_arguments_refused_by_name(make, error, message):
    with pytest.raises(error, match=message):
        make()


KV = dict(num_blocks=4, block_size=16, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("name,value,error,message", [
    ("block_size", 0, ValueError, "block_size must be a positive int, got 0"),
    ("block_size", True, TypeError, "block_size must be an int, not a bool"),
    ("num_blocks", np.True_, TypeError, "num_blocks must be an int, not a bool"),
    ("head_dim", 16.0, TypeError, "head_dim must be an int"),
    ("num_layers", -1, ValueError, "num_layers must be a positive int"),
])
def test_kv_cache_sizes_refused_by_name(name, value, error, message):
    with pytest.raises(error, match=rf"^PagedKVCache: {message}"):
        PagedKVCache(**{**KV, name: value})


def test_kv_cache_takes_numpy_integers_and_refuses_bools():
    cache = PagedKVCache(**{key: np.int64(value) for key, value in KV.items()}, num_layers=np.int32(1))
    assert (cache.block_size, cache.num_blocks) == (16, 4) and type(cache.block_size) is int
    seq = cache.add_sequence()
    slots = cache.reserve([np.int64(seq)], np.int32(3)).numpy()
    assert slots.tolist() == [[0, 1, 2]]
    cache.truncate(np.int64(seq), np.int64(1))
    assert cache.length(np.int64(seq)) == 1
    assert cache.block_table([seq], max_blocks=np.int16(2)).numpy().shape == (1, 2)
    with pytest.raises(TypeError, match=r"PagedKVCache\.reserve: tokens must be an int, not a bool"):
        cache.reserve([seq], True)
    with pytest.raises(TypeError, match=r"PagedKVCache\.truncate: length must be an int, not a bool"):
        cache.truncate(seq, False)
    with pytest.raises(TypeError, match=r"PagedKVCache\.length: a sequence id must be an int, not a bool"):
        cache.length(True)
    with pytest.raises(TypeError, match=r"PagedKVCache\.context_lens: seqs must be a list of sequence ids"):
        cache.context_lens(seq)
    with pytest.raises(ValueError, match=r"PagedKVCache\.reserve: tokens must be a positive int, got 0"):
        cache.reserve([seq], np.int64(0))


@pytest.fixture(scope="module")
def small_module():
    return bucket_module("flash_attn", dict(B=1, H=2, S=16, D=16))


@pytest.mark.parametrize("options,error,message", [
    (dict(trials_per_iter=0), ValueError, "trials_per_iter must be >= 1, got 0"),
    (dict(trials=-1), ValueError, "trials must be >= 0, got -1"),
    (dict(trials=True), TypeError, "trials must be an int, not a bool"),
    (dict(verify_rounds=0), ValueError, "verify_rounds must be >= 1"),
    (dict(ops="flash_attn"), TypeError, "ops must be a list of op names"),
    (dict(work_dir="{file}"), ValueError, "work_dir must be a directory, but .* is a file"),
    (dict(work_dir="{file}/logs"), ValueError, "work_dir .* cannot be created: .* is a file"),
    (dict(work_dir="{ro}"), ValueError, "work_dir .* is not writable"),
], ids=["trials_per_iter 0", "trials -1", "trials bool", "verify_rounds 0", "ops str", "work_dir file",
        "work_dir under file", "work_dir read-only"])
def test_tune_refuses_before_tuning(small_module, options, error, message, a_file, read_only_dir):
    if "work_dir" in options:
        options = dict(work_dir=options["work_dir"].replace("{file}", str(a_file)).replace("{ro}", str(read_only_dir)))
    with pytest.raises(error, match=rf"^tvm_fuel\.tune: {message}"):
        tune(small_module, HOST, log=lambda line: None, **options)


def test_tune_takes_numpy_integers(small_module, a_file):
    """numpy integers pass the argument checks (the run then stops at the unusable work_dir)."""
    with pytest.raises(ValueError, match="work_dir must be a directory"):
        tune(small_module, HOST, trials=np.int64(1), trials_per_iter=np.int32(1), verify_top=np.int8(0),
             work_dir=a_file, log=lambda line: None)


# --- where tune writes by default ---------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No tvm_fuel / XDG variables; HOME at a temporary directory; run from the repository root
    (where a relative tuning_logs was the shipped logs)."""
    for name in ("TVM_FUEL_TUNING_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(shipped_logs().parent)
    return tmp_path


def test_default_work_dir_is_the_user_cache_not_the_shipped_logs(clean_env, monkeypatch):
    home = clean_env / "home"
    assert default_work_dir() == home / ".cache" / "tvm_fuel" / "tuning_logs"
    assert default_work_dir().resolve() != shipped_logs().resolve()
    monkeypatch.setenv("XDG_CACHE_HOME", str(clean_env / "xdg"))
    assert default_work_dir() == clean_env / "xdg" / "tvm_fuel" / "tuning_logs"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid per the XDG spec: ignored
    assert default_work_dir() == home / ".cache" / "tvm_fuel" / "tuning_logs"
    monkeypatch.setenv("TVM_FUEL_TUNING_DIR", str(clean_env / "mine"))
    assert default_work_dir() == clean_env / "mine"
    monkeypatch.setenv("TVM_FUEL_TUNING_DIR", "tuning_logs")  # in a checkout the shipped logs, on purpose
    assert default_work_dir() == Path("tuning_logs")


def test_cli_defaults_follow_the_default_work_dir(clean_env, monkeypatch, capsys):
    def work_dir(argv):
        return build_parser().parse_args(argv).work_dir

    assert work_dir(["tune", "--op", "paged_attn"]) == str(default_work_dir())
    assert Path(work_dir(["tune", "--import", "results.json"])).resolve() != shipped_logs().resolve()
    monkeypatch.setenv("TVM_FUEL_TUNING_DIR", str(clean_env / "mine"))
    assert work_dir(["tune", "--op", "paged_attn"]) == str(clean_env / "mine")
    assert work_dir(["tune", "--op", "paged_attn", "--work-dir", "tuning_logs"]) == "tuning_logs"  # still possible
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: the path is not wrapped
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "--work-dir" in line and "default" in line]
    assert str(clean_env / "mine") in line and "$TVM_FUEL_TUNING_DIR" in line


def test_tune_function_defaults_to_the_default_work_dir(small_module, clean_env, a_file, monkeypatch):
    """The Python default is the same function's: an unusable $TVM_FUEL_TUNING_DIR is what it names."""
    assert inspect.signature(tune).parameters["work_dir"].default is None
    monkeypatch.setenv("TVM_FUEL_TUNING_DIR", str(a_file))
    with pytest.raises(ValueError, match=f"work_dir must be a directory, but {a_file} is a file"):
        tune(small_module, HOST, log=lambda line: None)


# --- database= that is a file -------------------------------------------------------------------

def test_compile_refuses_a_database_file(small_module, a_file):
    with pytest.raises(ValueError, match=r"tvm_fuel\.compile: database .* is a file"):
        tvm_fuel.transform.legalize(small_module, HOST, kernels="tuned", database=str(a_file))


def test_compile_refuses_a_database_of_another_kind(small_module):
    with pytest.raises(TypeError, match=r"tvm_fuel\.compile: database must be a path"):
        tvm_fuel.transform.legalize(small_module, HOST, kernels="tuned", database=5)


def test_bucket_with_a_zero_dim_names_it():
    from tvm_fuel.tuning.buckets import bucket_module

    with pytest.raises(ValueError, match=r"tvm_fuel tune: block_size must be an int >= 1, got 0"):
        bucket_module("paged_attn", dict(B=1, H=2, D=16, block_size=0, ctx=64))


def _reshaping_model():
    """main(x: [n, 4]) -> y + y where y = match_cast(reshape(x, -1), [m]): n is a parameter's dim,
    m one the body defines."""
    n, m = tirx.Var("n", "int64"), tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType((n, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            flat = bb.emit(relax.op.reshape(x, (-1,)))
            y = bb.match_cast(flat, relax.TensorType((m,), "float32"))
            out = bb.emit_output(bb.emit(relax.op.add(y, y)))
        bb.emit_func_output(out)
    return bb.get()


def test_specialize_refuses_a_dim_the_body_defines():
    """Issue 29, item 10: a point on a dim the body defines (match_cast) is refused by name (was:
    accepted, then the build failed with 'PrimExpr m ... has not been computed'); the parameters'
    dims remain points, and the specialized model runs at and off its point."""
    from tvm_fuel.transform.specialize import ShapePoint, specialize, symbolic_dims

    mod = _reshaping_model()
    assert set(symbolic_dims(mod["main"])) == {"n"}
    for dims in ({"m": 8}, {"n": 2, "m": 8}):
        with pytest.raises(ValueError, match=r"tvm_fuel\.specialize: main's dim 'm' is defined in its body "
                                             r"\(R\.match_cast\), not by its parameters: .*\('n' here\)"):
            specialize(mod, [ShapePoint("main", dims)])
    vm = relax.VirtualMachine(tvm.compile(specialize(mod, [ShapePoint("main", {"n": 2})]), target=HOST), tvm.cpu())
    for rows in (2, 3):
        x = np.arange(rows * 4, dtype="float32").reshape(rows, 4)
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), 2 * x.reshape(-1))
