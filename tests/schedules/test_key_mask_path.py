"""The CPU forward's key-mask path (issue 55, item 5): a mask the same for every query row (bool
[B, 1, 1, Sk] or [1, 1, 1, Sk], an additive [B, 1, 1, Sk] or per-head [B, Hq, 1, Sk] bias) is read
once per key tile and added to whole columns of scores, not loaded per score. Each kernel is built
once with symbolic Sq and Sk, its TIR checked for the per-tile reads, then run on every shape and
mask pattern against the float64 reference."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm
import tvm_ffi
from helpers import HOST, applied_knobs, assert_close, build, flatten, legalize_checked
from tvm import relax, tirx

from tvm_fuel import op
from tvm_fuel import reference as ref
from tvm_fuel.testing.compare import LSE_TOLERANCE

# one worker builds the module's kernels once (functools.cache), not both
pytestmark = [pytest.mark.numerics, pytest.mark.xdist_group("test_key_mask_path")]

B, HQ, HKV, D = 2, 6, 2, 40  # GQA group 3, a head dim of five 8-lane vectors
SQ, SK = tirx.Var("sq", "int64"), tirx.Var("sk", "int64")
F32_MIN = float(np.finfo(np.float32).min)
OPTIONS = {"full": dict(), "causal": dict(causal=True), "window": dict(window_size=(24, 5)),
           "softcap_alibi": dict(causal=True, softcap=5.0)}
# (mask kind, options): bool and additive [B, 1, 1, Sk] under every window; the other shapes causal
CASES = [("bool", name) for name in ("full", "causal", "window")] + [
    ("bias", name) for name in ("full", "causal", "window", "softcap_alibi")] + [
    ("bool_shared", "causal"), ("bias_per_head", "causal"), ("bias_per_head", "window")]
MASK_SHAPES = {"bool": (B, 1, 1), "bool_shared": (1, 1, 1), "bias": (B, 1, 1), "bias_per_head": (B, HQ, 1)}
PATTERNS = ("all_kept", "random", "whole_tiles_dropped", "batch_dropped")
SIZES = [(sq, sk) for sk in (1, 17, 97, 130) for sq in sorted({1, sk})]
# (ALiBi or a softcap cost the backward kernel's build 5 s more: the forward checks them beside a key mask)
BACKWARD_CASES = [("bool", "causal"), ("bias_per_head", "window"), ("bias", "full")]


def _mask_heads(kind: str) -> int:
    return HQ // HKV if kind == "bias_per_head" else 1


@functools.cache
def _kernel(kind: str, options: str, backward: bool = False):
    """(the legalized kernel PrimFunc, a VM running the module) of flash_attn (out, lse) or, ``backward``,
    flash_attn_backward (dq, dk, dv; its forward kernel too) with a ``kind`` mask."""
    mask_dtype = "bool" if kind.startswith("bool") else "float32"
    params = dict(q=((B, HQ, SQ, D), "float32"), k=((B, HKV, SK, D), "float32"), v=((B, HKV, SK, D), "float32"),
                  mask=((*MASK_SHAPES[kind], SK), mask_dtype))
    if backward:
        params["do"] = ((B, HQ, SQ, D), "float32")
    if options == "softcap_alibi":
        params["slopes"] = ((HQ,), "float32")

    def make(q, k, v, mask, do=None, slopes=None):
        if backward:
            return op.flash_attn_backward(q, k, v, do, slopes, mask, **OPTIONS[options])
        return op.flash_attn(q, k, v, slopes, mask, return_lse=True, **OPTIONS[options])

    legalized = legalize_checked(build(make, params), HOST, "tuned")
    kernel = legalized["fuel_flash_attn_backward_kernel" if backward else "fuel_flash_attn_kernel"]
    return kernel, relax.VirtualMachine(tvm.compile(legalized, target=HOST), tvm.cpu())


def _mask(kind: str, pattern: str, sk: int, rng, *, huge: float = F32_MIN) -> np.ndarray:
    """A ``kind`` mask of ``pattern``; ``huge``: the large finite bias that weighs keys down."""
    shape = (*MASK_SHAPES[kind], sk)
    if kind.startswith("bool"):
        keep = {"all_kept": np.ones(shape, bool), "random": rng.random(shape) < 0.7}.get(pattern)
        if keep is None:
            keep = rng.random(shape) < 0.9
            if pattern == "whole_tiles_dropped":  # the first key tile (64 or 128 keys) and more
                keep[..., :min(sk, 130)] = False
                keep[..., -1:] = True
            else:
                keep[-1] = False  # the last batch row (or the shared mask) drops every key
        return keep
    bias = (rng.standard_normal(shape) * 2).astype(np.float32)
    if pattern == "all_kept":
        return np.zeros(shape, np.float32)
    if pattern == "random":
        bias[rng.random(shape) < 0.2] = -np.inf
        bias[rng.random(shape) < 0.1] = huge
    elif pattern == "whole_tiles_dropped":
        bias[..., :min(sk, 130)] = -np.inf
        bias[0, ..., 1:min(sk, 70)] = huge  # a finite bias only weighs its keys down
        bias[..., -1:] = 0.5
    else:
        bias[-1] = -np.inf
    return bias


def _per_tile_mask_loads(kernel: tirx.PrimFunc) -> list[int]:
    """For each load of the mask in the kernel's TIR: how many times it runs per (task, key tile),
    the product of the constant extents of the loops around it but the parallel ones (the runs of
    tasks; the task and key-tile loops have symbolic extents)."""
    loads, loops = [], []
    tvm_ffi.structural_walk(kernel.body, (tvm.ir.TensorLoad, lambda n: loads.append(n) if n.source.name == "mask"
                                          else None))
    tvm_ffi.structural_walk(kernel.body, (tirx.For, loops.append))
    counts = []
    for load in loads:
        count = 1
        for loop in loops:
            inside = []
            tvm_ffi.structural_walk(loop.body, (tvm.ir.TensorLoad, lambda n: inside.append(n) if n.same_as(load)
                                                else None))
            if inside and isinstance(loop.extent, tirx.IntImm) and loop.kind != tirx.ForKind.PARALLEL:
                count *= int(loop.extent)
        counts.append(count)
    return counts


def _block_k(kernel: tirx.PrimFunc) -> int:
    return applied_knobs(kernel)["block_k"]


@pytest.mark.parametrize("kind, options", CASES)
def test_the_key_mask_is_read_once_per_key_tile(kind, options):
    kernel, _ = _kernel(kind, options)
    counts, block_k = _per_tile_mask_loads(kernel), _block_k(kernel)
    assert counts, "the kernel reads no mask"
    # one read per key (and per query head of the group for a per-head bias), not one per score
    assert max(counts) <= _mask_heads(kind) * block_k, (counts, block_k)


@pytest.mark.parametrize("kind, options", BACKWARD_CASES)
def test_the_backward_reads_the_key_mask_once_per_key_tile_and_query_head(kind, options):
    kernel, _ = _kernel(kind, options, backward=True)
    counts, block_k = _per_tile_mask_loads(kernel), _block_k(kernel)
    assert counts, "the kernel reads no mask"
    # per (key tile, query tile) pair the loops over the group's heads and the tile's keys, not its rows
    assert max(counts) <= HQ // HKV * block_k, (counts, block_k)


def test_a_full_mask_stays_per_score():
    """The same check sees a [B, Hq, Sq, Sk] mask read per score (the path a key mask no longer takes)."""
    params = dict(q=((B, HQ, SQ, D), "float32"), k=((B, HKV, SK, D), "float32"), v=((B, HKV, SK, D), "float32"),
                  mask=((B, HQ, SQ, SK), "bool"))
    legalized = legalize_checked(build(lambda q, k, v, mask: op.flash_attn(q, k, v, None, mask, causal=True), params),
                                 HOST, "tuned")
    counts, block_k = _per_tile_mask_loads(legalized["fuel_flash_attn_kernel"]), _block_k(
        legalized["fuel_flash_attn_kernel"])
    assert max(counts) > HQ * block_k, (counts, block_k)


@pytest.mark.parametrize("sq, sk", SIZES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("kind, options", CASES)
def test_key_masks_match_the_reference(kind, options, pattern, sq, sk):
    rng = np.random.default_rng(sq * 1000 + sk)
    q = rng.standard_normal((B, HQ, sq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, HKV, sk, D)).astype(np.float32) for _ in range(2))
    mask = _mask(kind, pattern, sk, rng)
    slopes = rng.uniform(0.0, 0.5, HQ).astype(np.float32) if options == "softcap_alibi" else None
    _, vm = _kernel(kind, options)
    args = [q, k, v, mask] + ([slopes] if slopes is not None else [])
    out, lse = flatten(vm["main"](*[tvm.runtime.tensor(a) for a in args]))
    want_out, want_lse = ref.flash_attn(q, k, v, slopes, mask, return_lse=True, **OPTIONS[options])
    assert_close(out, want_out, "float32", what="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), err_msg="rows without keys")
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1],
                               err_msg="lse")


def test_a_nan_bias_reaches_only_the_rows_that_see_its_key():
    """A NaN bias on the last key: causal rows before it never see it (the window's rule comes
    first), the last row is NaN (the NaN rule, tvm_fuel.op.semantics)."""
    rng = np.random.default_rng(7)
    sq = sk = 97
    q = rng.standard_normal((B, HQ, sq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, HKV, sk, D)).astype(np.float32) for _ in range(2))
    bias = np.zeros((B, 1, 1, sk), np.float32)
    bias[..., -1] = np.nan
    _, vm = _kernel("bias", "causal")
    out, _ = flatten(vm["main"](*[tvm.runtime.tensor(a) for a in (q, k, v, bias)]))
    want = ref.flash_attn(q, k, v, None, bias, causal=True)
    assert np.isnan(out[:, :, -1]).all()
    assert_close(out[:, :, :-1], want[:, :, :-1], "float32", what="out")


@pytest.mark.parametrize("sq, sk", [(1, 17), (97, 97), (130, 130)])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("kind, options", BACKWARD_CASES)
def test_key_mask_gradients_match_the_reference(kind, options, pattern, sq, sk):
    """dq, dk, dv with the mask read per tile (biases of -30, not finfo.min: a float32 lse cannot
    hold log(n) beside a huge bias, see test_finite_bias.py)."""
    rng = np.random.default_rng(sq * 1000 + sk)
    q, do = (rng.standard_normal((B, HQ, sq, D)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, HKV, sk, D)).astype(np.float32) for _ in range(2))
    mask = _mask(kind, pattern, sk, rng, huge=-30.0)
    slopes = rng.uniform(0.0, 0.5, HQ).astype(np.float32) if options == "softcap_alibi" else None
    _, vm = _kernel(kind, options, backward=True)
    args = [q, k, v, mask, do] + ([slopes] if slopes is not None else [])
    got = flatten(vm["main"](*[tvm.runtime.tensor(a) for a in args]))
    want = ref.flash_attn_backward(q, k, v, do, slopes, mask, **OPTIONS[options])
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, "float32", scale=2.0, what=name)
