"""Many tiny rows (issue 55): a batch of short sequences costs what its own rows and keys need.

The dense forward of decode-shaped calls (at most STREAMING_ROWS rows per KV head) streams its keys
in place (``schedules.cpu.decode``), checked against the float64 reference on awkward shapes with
the path asserted; the backward's tiles and dq partials follow Sq and Sk; the varlen kernels pack
only whole key tiles. Memory is measured as a child process's peak RSS growth over one call, at
the shapes of the report (B 2048 x H 8 x S 1, D 64: the old kernels grew by 0.3-1 GiB).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm

import tvm_fuel
from tvm_fuel import op, reference
from tvm_fuel.schedules.cpu.rules import SHORT_KEYS
from tvm_fuel.schedules.cpu.tiles import STREAMING_ROWS

from helpers import HOST, Runner, applied_knobs, assert_close, build, dense_inputs

pytestmark = pytest.mark.numerics


def _kernel(mod: tvm.IRModule, name: str = "fuel_flash_attn_kernel") -> tvm.tirx.PrimFunc:
    legalized = tvm_fuel.transform.legalize(mod, tvm_fuel.target.as_target(HOST), kernels="tuned")
    kernels = [f for gv, f in legalized.functions.items() if gv.name_hint.startswith(name)]
    assert len(kernels) == 1, f"expected one {name}, found {[gv.name_hint for gv in legalized.functions]}"
    return kernels[0]


def _packs_keys(func: tvm.tirx.PrimFunc) -> bool:
    """Whether the kernel packs key tiles into a workspace (the register-tiled kernel's k_tiles)."""
    return "k_tiles" in func.script()


@pytest.mark.parametrize("heads", [(8, 8), (6, 2), (7, 1)], ids=lambda h: f"Hq{h[0]}Hkv{h[1]}")
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 17), (1, 97), (2, 17), (1, 130), (16, 16), (13, 9)])
@pytest.mark.parametrize("option", ["plain", "causal", "window", "key_mask", "lse"])
def test_decode_shaped_dense_forward_streams_and_matches_reference(heads, sq, sk, option):
    hq, hkv = heads
    if sq * (hq // hkv) > STREAMING_ROWS and (sq * (hq // hkv) > 2 * STREAMING_ROWS or sk > SHORT_KEYS):
        pytest.skip("more rows than a decode-shaped call streams")
    rng = np.random.default_rng(sq * 1000 + sk)
    inputs = dense_inputs(rng, 3, hq, hkv, sq, sk, 40)
    kwargs = dict(causal=option == "causal", window_size=(8, 0) if option == "window" else (-1, -1),
                  return_lse=option == "lse")
    if option == "key_mask":
        mask = rng.random((3, 1, 1, sk)) > 0.3
        mask[1] = False  # a batch whose every key is masked: its rows are 0
        inputs["attn_mask"] = mask
    mod = build(lambda **v: op.flash_attn(**v, **kwargs), {n: (a.shape, str(a.dtype)) for n, a in inputs.items()})
    kernel = _kernel(mod)
    assert not _packs_keys(kernel), "a decode-shaped call packed its keys (the register-tiled kernel ran)"
    assert applied_knobs(kernel)["block_q"] <= STREAMING_ROWS
    got = Runner(mod, HOST, kernels="tuned")(*inputs.values())
    want = reference.flash_attn(**inputs, **kwargs)
    want = want if isinstance(want, tuple) else (want,)
    for actual, expected, what in zip(got, want, ("out", "lse")):
        assert_close(actual, expected, "float32", what=what)


def test_tile_sizes_follow_a_static_key_count():
    # 17 rows per KV head take the register-tiled kernel; with 3 keys its key tiles are one vector wide
    rng = np.random.default_rng(0)
    inputs = dense_inputs(rng, 2, 4, 4, 17, 3, 64)
    mod = build(lambda **v: op.flash_attn(**v, causal=True), {n: (a.shape, str(a.dtype)) for n, a in inputs.items()})
    kernel = _kernel(mod)
    assert _packs_keys(kernel)
    knobs = applied_knobs(kernel)
    assert knobs["block_k"] == knobs["lanes"] * knobs["key_vecs"] and knobs["key_vecs"] == 1
    got = Runner(mod, HOST, kernels="tuned")(*inputs.values())
    assert_close(got[0], reference.flash_attn(**inputs, causal=True), "float32")


@pytest.mark.parametrize("sq,sk", [(1, 1), (3, 5), (17, 2)])
def test_backward_tiles_follow_sq_and_sk(sq, sk):
    rng = np.random.default_rng(sq + sk)
    inputs = dense_inputs(rng, 5, 6, 2, sq, sk, 40, with_do=True)
    mod = build(lambda **v: op.flash_attn_backward(**v, causal=True),
                {n: (a.shape, str(a.dtype)) for n, a in inputs.items()})
    kernel = _kernel(mod, "fuel_flash_attn_backward_kernel")
    knobs = applied_knobs(kernel)
    assert knobs["block_q"] < sq + knobs["micro_rows"] and knobs["block_k"] <= knobs["lanes"] * 2
    got = Runner(mod, HOST, kernels="tuned")(*inputs.values())
    want = reference.flash_attn_backward(**inputs, causal=True)
    for actual, expected, what in zip(got, want, ("dq", "dk", "dv")):
        assert_close(actual, expected, "float32", scale=4.0, what=what)


_PEAK_RSS = textwrap.dedent("""
    import json, resource, sys
    import numpy as np, tvm
    from tvm import relax
    import tvm_fuel
    from tvm_fuel import op
    case, kernels = sys.argv[1], sys.argv[2]
    B, H, D = 2048, 8, 64
    rng = np.random.default_rng(0)
    if case == "varlen":
        shape, names = (B, H, D), ["q", "k", "v"]
        extra = {"cu_seqlens_q": np.arange(B + 1, dtype=np.int32), "cu_seqlens_k": np.arange(B + 1, dtype=np.int32)}
        make = lambda **v: op.flash_attn_varlen(**v, max_seqlen_q=1, max_seqlen_k=1, causal=True)
    else:
        shape = (B, H, 1, D)
        names = ["q", "k", "v"] + (["do", "out"] if case == "backward" else [])
        extra = {"lse": np.zeros((B, H, 1), np.float32)} if case == "backward" else {}
        make = (lambda **v: op.flash_attn_backward(**v, causal=True)) if case == "backward" else (
            lambda **v: op.flash_attn(**v, causal=True))
    arrays = {n: rng.standard_normal(shape).astype(np.float32) for n in names}
    arrays.update(extra)
    variables = {n: relax.Var(n, relax.TensorType(a.shape, str(a.dtype))) for n, a in arrays.items()}
    bb = relax.BlockBuilder()
    with bb.function("main", list(variables.values())):
        bb.emit_func_output(bb.emit(make(**variables)))
    vm = relax.VirtualMachine(tvm_fuel.compile(bb.get(), tvm_fuel.target.host_target(), kernels=kernels), tvm.cpu())
    tensors = [tvm.runtime.tensor(a) for a in arrays.values()]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    vm["main"](*tensors)
    print(json.dumps({"growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
""")


def _peak_rss_growth(case: str, kernels: str) -> float:
    run = subprocess.run([sys.executable, "-c", _PEAK_RSS, case, kernels], capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])["growth_mib"]


@pytest.mark.parametrize("case", ["forward", "backward", "varlen"])
def test_many_one_token_sequences_grow_memory_by_their_own_size(case):
    # one call over 2048 x 8 one-token rows (4 MiB per [B, H, 1, D] float32 tensor): the outputs and
    # a few of them in scratch, not a whole key tile (64 keys) per row as the old kernels allocated
    # (forward 1032 MiB, backward 280 MiB, varlen 1024 MiB on the report's machine)
    growth = _peak_rss_growth(case, "tuned")
    assert growth <= 64, f"{case}: peak RSS grew by {growth:.0f} MiB over one call"
