"""Many tiny rows (issue 55): a batch of short sequences costs what its own rows and keys need.

Decode-shaped dense forwards (at most STREAMING_ROWS rows per KV head) stream their keys in place
(``schedules.cpu.decode``); calls over a handful of keys (at most SHORT_KEYS, and 16 queries) take
their rows one at a time, forward and backward (``decode.dense_rows_forward``, ``backward_rows``);
varlen calls whose max_seqlen bound every sequence to a few rows do the same. Each is checked
against the float64 reference on awkward shapes and options with the path asserted (the NaN rule
too). Memory is measured as a child process's peak RSS growth over one call, at the shapes of the
report (B 2048 x H 8 x S 1, D 64: the old kernels grew by 0.3-1 GiB).
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

from covering import pairwise
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


def _streamed(heads, shape, option) -> bool:
    """Whether a call of ``heads`` and ``shape`` (sq, sk) is decode-shaped (few enough rows to stream)."""
    rows = shape[0] * (heads[0] // heads[1])
    return rows <= STREAMING_ROWS or (rows <= 2 * STREAMING_ROWS and shape[1] <= SHORT_KEYS)


# each pair of a GQA group, a shape and an option that a decode-shaped call can hold (each case
# builds its own kernel; the full product is 105 cases, 15 of them not decode-shaped)
_DECODE_CASES = pairwise([(8, 8), (6, 2), (7, 1)], [(1, 1), (1, 17), (1, 97), (2, 17), (1, 130), (16, 16), (13, 9)],
                         ["plain", "causal", "window", "key_mask", "lse"], valid=_streamed)


@pytest.mark.parametrize("heads,shape,option", _DECODE_CASES,
                         ids=[f"Hq{h[0]}Hkv{h[1]}-sq{s[0]}sk{s[1]}-{o}" for h, s, o in _DECODE_CASES])
def test_decode_shaped_dense_forward_streams_and_matches_reference(heads, shape, option):
    (hq, hkv), (sq, sk) = heads, shape
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
    # a handful of keys: rows one at a time (decode.dense_rows_forward); more: the streaming tasks
    assert _takes_rows(kernel) == (sk <= SHORT_KEYS)
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


def _shapes(inputs: dict[str, np.ndarray]) -> dict[str, tuple]:
    return {n: (a.shape, str(a.dtype)) for n, a in inputs.items()}


def _takes_rows(func: tvm.tirx.PrimFunc) -> bool:
    """Whether a backward kernel runs its rows one at a time (``backward_rows``: its q_row scratch)."""
    return "q_row" in func.script()


_SHORT_SHAPES = [(1, 1), (4, 1), (3, 5), (13, 9), (16, 16)]
_SHORT_OPTIONS = ["plain", "causal", "window_softcap", "alibi_bias", "key_mask", "dq", "dk", "dv"]
_GROUPS = [(8, 8), (6, 2), (7, 1)]  # GQA groups 1, 3, 7


# every option on every shape, the GQA group cycling with them (each case builds its own kernel)
@pytest.mark.parametrize("sq,sk,option,heads", [
    (sq, sk, option, _GROUPS[(n + m) % 3]) for n, (sq, sk) in enumerate(_SHORT_SHAPES)
    for m, option in enumerate(_SHORT_OPTIONS)])
def test_short_backward_takes_rows_and_matches_reference(sq, sk, option, heads):
    hq, hkv = heads
    rng = np.random.default_rng(sq * 100 + sk)
    inputs = dense_inputs(rng, 3, hq, hkv, sq, sk, 40, with_do=True)
    kwargs = dict(causal=option in ("causal", "dq", "dk", "dv"),
                  window_size=(2, 1) if option == "window_softcap" else (-1, -1),
                  softcap=5.0 if option == "window_softcap" else 0.0)
    if option == "alibi_bias":
        inputs["alibi_slopes"] = rng.uniform(0.1, 1.0, hq).astype(np.float32)
        inputs["attn_mask"] = rng.standard_normal((3, hq, sq, sk)).astype(np.float32)
        inputs["attn_mask"][0, :, :, 0] = -np.inf
    if option == "key_mask":
        mask = rng.random((3, 1, 1, sk)) > 0.3
        mask[1] = False  # a batch whose every key is masked: no gradient at all
        inputs["attn_mask"] = mask
    single = option in ("dq", "dk", "dv")  # the single-gradient ops, each its own kernel
    name = f"flash_attn_backward_{option[1]}" if single else "flash_attn_backward"
    mod = build(lambda **v: getattr(op, name)(**v, **kwargs), _shapes(inputs))
    assert _takes_rows(_kernel(mod, f"fuel_{name}_kernel")), "a short backward ran the register-tiled tasks"
    got = Runner(mod, HOST, kernels="tuned")(*inputs.values())
    want = dict(zip(("dq", "dk", "dv"), reference.flash_attn_backward(**inputs, **kwargs)))
    for actual, what in zip(got, (option,) if single else ("dq", "dk", "dv")):
        assert_close(actual, want[what], "float32", scale=4.0, what=what)


def test_short_rows_in_bfloat16_and_the_nan_rule():
    # a NaN value reaches exactly the rows (and gradients) that see its key: the forward's and the
    # backward's rows kernels against the float64 reference
    rng = np.random.default_rng(7)
    inputs = dense_inputs(rng, 2, 6, 2, 3, 7, 64, with_do=True)
    inputs["v"][0, 0, 6] = np.nan  # key 6 of batch 0: dropped for rows 0, 1 (causal, bottom-right)
    forward = {n: inputs[n] for n in "qkv"}
    mod = build(lambda **v: op.flash_attn(**v, causal=True, return_lse=True), _shapes(forward))
    assert _takes_rows(_kernel(mod))
    out, lse = Runner(mod, HOST, kernels="tuned")(*forward.values())
    want_out, want_lse = reference.flash_attn(**forward, causal=True, return_lse=True)
    assert (np.isnan(out) == np.isnan(want_out)).all() and np.isnan(out).any()
    assert_close(out[~np.isnan(want_out)], want_out[~np.isnan(want_out)], "float32", what="out")
    assert_close(lse, want_lse, "float32", what="lse")
    mod = build(lambda **v: op.flash_attn_backward(**v, causal=True), _shapes(inputs))
    assert _takes_rows(_kernel(mod, "fuel_flash_attn_backward_kernel"))
    dq, dk, dv = Runner(mod, HOST, kernels="tuned")(*inputs.values())
    want = reference.flash_attn_backward(**inputs, causal=True)
    for actual, expected, what in zip((dq, dk, dv), want, ("dq", "dk", "dv")):
        assert (np.isnan(actual) == np.isnan(expected)).all(), what
        finite = ~np.isnan(expected)
        assert_close(actual[finite], expected[finite], "float32", scale=4.0, what=what)
    bf16 = dense_inputs(rng, 2, 7, 1, 2, 16, 128, "bfloat16", with_do=True)
    mod = build(lambda **v: op.flash_attn_backward(**v, window_size=(4, 4)), _shapes(bf16))
    assert _takes_rows(_kernel(mod, "fuel_flash_attn_backward_kernel"))
    got = Runner(mod, HOST, kernels="tuned")(*bf16.values())
    want = reference.flash_attn_backward(**bf16, window_size=(4, 4))
    for actual, expected, what in zip(got, want, ("dq", "dk", "dv")):
        assert_close(actual, expected, "bfloat16", scale=4.0, what=what)


@pytest.mark.parametrize("max_seqlen", [(2, 5), (None, None)], ids=["bounded", "unbounded"])
def test_short_varlen_sequences_take_rows(max_seqlen):
    """max_seqlen_q, max_seqlen_k bounding every sequence to a few rows and keys: the forward and the
    backward take rows (nothing packed, no dq partials); without them the packed kernels run. Both
    against the float64 reference, empty sequences and a row past the last."""
    rng = np.random.default_rng(3)
    q_lens, k_lens = [1, 0, 2, 1, 2, 1], [1, 3, 5, 0, 2, 4]
    cu_q, cu_k = np.cumsum([0, *q_lens]).astype(np.int32), np.cumsum([0, *k_lens]).astype(np.int32)
    inputs = dict(q=rng.standard_normal((cu_q[-1] + 1, 6, 40)).astype(np.float32),
                  k=rng.standard_normal((cu_k[-1], 2, 40)).astype(np.float32),
                  v=rng.standard_normal((cu_k[-1], 2, 40)).astype(np.float32),
                  do=rng.standard_normal((cu_q[-1] + 1, 6, 40)).astype(np.float32), cu_seqlens_q=cu_q,
                  cu_seqlens_k=cu_k)
    limits = dict(max_seqlen_q=max_seqlen[0], max_seqlen_k=max_seqlen[1], causal=True)
    shapes = _shapes(inputs)
    forward = {n: shapes[n] for n in shapes if n != "do"}
    fwd = build(lambda **v: op.flash_attn_varlen(**v, **limits), forward)
    bwd = build(lambda **v: op.flash_attn_varlen_backward(**v, **limits), shapes)
    fwd_kernel = _kernel(fwd, "fuel_flash_attn_varlen_kernel")
    bwd_kernel = _kernel(bwd, "fuel_flash_attn_varlen_backward_kernel")
    bounded = max_seqlen[0] is not None
    assert _packs_keys(fwd_kernel) != bounded and _takes_rows(fwd_kernel) == bounded
    assert _takes_rows(bwd_kernel) == bounded
    out = Runner(fwd, HOST, kernels="tuned")(*(inputs[n] for n in forward))[0]
    want = reference.flash_attn_varlen(*(inputs[n] for n in forward), causal=True)
    assert_close(out[:-1], want[:-1], "float32", what="out")
    grads = Runner(bwd, HOST, kernels="tuned")(*inputs.values())
    want = reference.flash_attn_varlen_backward(*(inputs[n] for n in ("q", "k", "v", "do", "cu_seqlens_q",
                                                                     "cu_seqlens_k")), causal=True)
    for actual, expected, what in zip(grads, want, ("dq", "dk", "dv")):
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
