"""Finite additive masks stay finite on every path (issue 29, item 2).

Hugging Face's eager attention masks with ``finfo(dtype).min``: a left-padded row carries it on
every key. The kernels that take their softmax in base 2 multiply each logit by log2(e), which
turned ``finfo(float32).min`` into ``-inf``: such a row came out 0 (as a dropped row) where PyTorch
and the floor give the mean of its values. The masks here hold ``finfo(float32).min``, -1e38,
``-inf`` and the mask dtype's own ``finfo.min`` (one per batch row), in float32, float16 and
bfloat16, on rows that carry the value on every key, on some keys, beside ``-inf`` keys and beside
-1e38. Forward (out, lse), backward (dq, dk, dv), the JVP and the double backward run through the
CPU kernels, the floor, the expansion and the CUDA kernels' emulation, against PyTorch.

A row whose every visible key carries a huge bias has an lse of that size, and a float32 lse there
cannot hold log(n): a gradient that takes P = exp(logit - lse) weighs each key 1 instead of 1/n
(PyTorch's own fused CPU kernel does the same; its math backend weighs them 1/n). The gradients are
compared with PyTorch where such rows get no output gradient (a padding row's loss gradient is 0);
where they do, the kernels must agree with the floor (P from the lse on both) and the expansion,
which takes the softmax of whole rows, with PyTorch's math backend.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import tvm
from torch.nn.attention import SDPBackend, sdpa_kernel
from helpers import (CUDA_EMULATED, NP_DTYPE, applied_knobs, assert_close, build, flatten, legalize_checked,
                     legalize_cuda_emulated)
from tvm import relax, tirx

import tvm_fuel
from tvm_fuel import op
from tvm_fuel.testing.compare import LSE_TOLERANCE, TOLERANCE
from tvm_fuel.dispatch.records import KnobMatch

pytestmark = [pytest.mark.numerics, pytest.mark.xdist_group("test_finite_bias")]

F32_MIN = float(np.finfo(np.float32).min)
DTYPES = ("float32", "float16", "bfloat16")
B, HQ, HKV, SQ, SK, D = 4, 2, 1, 7, 37, 32
SCALE = D ** -0.5
HUGE = 2.0 ** 24  # a row whose largest bias is below -HUGE has an lse too large to hold log(n)
EXPANDED = "expanded"


def _values(dtype: str) -> list[float]:
    """The mask value of each batch row: finfo(float32).min, -1e38, -inf, finfo(dtype).min."""
    return [F32_MIN, -1e38, float("-inf"), float(np.finfo(NP_DTYPE[dtype]).min)]


def _mask(dtype: str, rng) -> np.ndarray:
    """[B, 1, Sq, Sk] in ``dtype``; batch row b carries value v = _values(dtype)[b]:
    row 0 all v; row 1 v past the first 10 keys; row 2 v on even keys; row 3 ordinary biases;
    row 4 -inf on the first half, v on the rest; row 5 -1e38 on the first 5 keys, v on the rest;
    row 6 v past the last key but one."""
    mask = np.zeros((B, 1, SQ, SK), np.float32)
    for b, v in enumerate(_values(dtype)):
        m = mask[b, 0]
        m[0] = v
        m[1, 10:] = v
        m[2, ::2] = v
        m[3] = rng.standard_normal(SK)
        m[4, :SK // 2], m[4, SK // 2:] = float("-inf"), v
        m[5, :5], m[5, 5:] = -1e38, v
        m[6, :-1] = v
    return mask.astype(NP_DTYPE[dtype])


@functools.cache
def _inputs(dtype: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(29)
    shapes = dict(q=(B, HQ, SQ, D), k=(B, HKV, SK, D), v=(B, HKV, SK, D), do=(B, HQ, SQ, D),
                  q_dot=(B, HQ, SQ, D), k_dot=(B, HKV, SK, D), v_dot=(B, HKV, SK, D))
    arrays = {name: rng.standard_normal(shape).astype(NP_DTYPE[dtype]) for name, shape in shapes.items()}
    arrays["mask"] = _mask(dtype, rng)
    return arrays


def _huge_rows(mask: np.ndarray) -> np.ndarray:
    """[B, 1, Sq, 1]: rows whose largest bias is a huge finite value (their lse cannot hold log n)."""
    top = mask.astype(np.float64).max(axis=-1, keepdims=True)
    return np.isfinite(top) & (top < -HUGE)


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


# ---- PyTorch -----------------------------------------------------------------------------------

def _torch(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(_f64(a).astype(np.float32), requires_grad=grad)


def _sdpa(q, k, v, mask):
    group = HQ // HKV
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, scale=SCALE)


@functools.cache
def _torch_forward(dtype: str):
    """PyTorch's out on the same (rounded) inputs in float32, and the lse of its logits with the
    bias bounded at -2^127 (the documented bound; -inf stays -inf)."""
    a = _inputs(dtype)
    q, k, v, mask = (_torch(a[n]) for n in ("q", "k", "v", "mask"))
    out = _sdpa(q, k, v, mask)
    bounded = torch.where(torch.isinf(mask), mask, mask.clamp(-2.0 ** 127, 2.0 ** 127))
    logits = SCALE * q @ k.repeat_interleave(HQ // HKV, 1).transpose(-1, -2) + bounded
    return out.detach().numpy().astype(np.float64), torch.logsumexp(logits, -1).numpy().astype(np.float64)


def _padding_do(dtype: str) -> np.ndarray:
    """do with the rows of huge biases zeroed (as a padding row's loss gradient is)."""
    a = _inputs(dtype)
    return np.where(_huge_rows(a["mask"]), 0, a["do"]).astype(a["do"].dtype)


@functools.cache
def _torch_backward(dtype: str, padding_do: bool = True):
    """PyTorch's dq, dk, dv; with ``padding_do`` False, do on every row, through its math backend
    (which weighs the keys of rows of huge biases 1/n)."""
    a = _inputs(dtype)
    q, k, v = (_torch(a[n], grad=True) for n in ("q", "k", "v"))
    if padding_do:
        _sdpa(q, k, v, _torch(a["mask"])).backward(_torch(_padding_do(dtype)))
    else:
        with sdpa_kernel(SDPBackend.MATH):
            _sdpa(q, k, v, _torch(a["mask"])).backward(_torch(a["do"]))
    return [t.grad.numpy().astype(np.float64) for t in (q, k, v)]


@functools.cache
def _torch_jvp(dtype: str):
    a = _inputs(dtype)
    primals = tuple(_torch(a[n]) for n in ("q", "k", "v"))
    tangents = tuple(_torch(a[n]) for n in ("q_dot", "k_dot", "v_dot"))
    mask = _torch(a["mask"])
    with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernel has no forward mode
        out, out_dot = torch.func.jvp(lambda q, k, v: _sdpa(q, k, v, mask), primals, tangents)
    return out.numpy().astype(np.float64), out_dot.numpy().astype(np.float64)


# ---- the paths ---------------------------------------------------------------------------------

def _module(dtype: str, higher_order: bool) -> tvm.IRModule:
    names = ("q", "k", "v", "do", "mask") + (("q_dot", "k_dot", "v_dot") if higher_order else ())
    params = {n: (_inputs(dtype)[n].shape, dtype) for n in names}

    def make(q, k, v, do, mask, q_dot=None, k_dot=None, v_dot=None):
        if not higher_order:
            return relax.Tuple([op.flash_attn(q, k, v, None, mask, return_lse=True),
                                op.flash_attn_backward(q, k, v, do, None, mask)])
        return relax.Tuple([op.flash_attn_jvp(q, k, v, q_dot, k_dot, v_dot, None, mask, return_lse=True),
                            op.flash_attn_double_backward(q, k, v, do, q_dot, k_dot, v_dot, None, mask)])

    return build(make, params)


class _CudaKnobs:
    """The emulated CUDA kernels' knobs: the forward splits its 3 key tiles of 16 in two (32 keys
    and 5), so the split-KV merge weighs partial rows of unequal counts."""

    def lookup(self, workload, target):
        knobs = dict(block_q=16, block_k=16, threads=32)
        return KnobMatch(dict(knobs, splits=2) if workload.op == "flash_attn" else knobs, "test_finite_bias")

CPU_KERNELS = {False: {"fuel_flash_attn_kernel", "fuel_flash_attn_backward_kernel"},
               True: {"fuel_flash_attn_jvp_kernel", "fuel_flash_attn_double_backward_kernel"}}


@functools.cache
def _vm(dtype: str, kernels: str, higher_order: bool = False) -> relax.VirtualMachine:
    """The module of ``_module`` built through the path ``kernels`` (once: both output gradients run
    on it). The higher-order ops are a module of their own: their kernels with a float mask compile
    for 13 s (the double backward 12), which the forward and backward tests need not wait for."""
    mod = _module(dtype, higher_order)
    host = tvm_fuel.host_target()
    if kernels == EXPANDED:
        legalized = tvm_fuel.transform.legalize(tvm_fuel.transform.ExpandAttention()(mod), host, kernels="decomposed")
        assert not [gv for gv in legalized.functions if gv.name_hint.startswith("fuel_")], "not expanded"
    elif kernels == CUDA_EMULATED:
        legalized = legalize_cuda_emulated(mod, host, _CudaKnobs())
        kernel_names = {gv.name_hint for gv, f in legalized.functions.items()
                        if isinstance(f, tirx.PrimFunc) and f.attrs is not None and "fuel.workload" in f.attrs}
        assert {"fuel_flash_attn_kernel", "fuel_flash_attn_backward_kernel"} <= kernel_names, kernel_names
        assert applied_knobs(legalized["fuel_flash_attn_kernel"])["splits"] == 2
        assert not [gv for gv in legalized.functions if gv.name_hint in ("fuel_flash_attn", "fuel_flash_attn_backward")]
    else:
        legalized = legalize_checked(mod, host, kernels)  # asserts no op with a kernel fell back to the floor
        if kernels == "tuned":
            assert CPU_KERNELS[higher_order] <= {gv.name_hint for gv in legalized.functions}
    return relax.VirtualMachine(tvm.compile(legalized, target=host), tvm.cpu())


@functools.cache
def _run(dtype: str, kernels: str, zero_padding_do: bool = False, higher_order: bool = False) -> list[np.ndarray]:
    """The outputs of the path ``kernels``: forward (out, lse) and backward (dq, dk, dv) or, with
    ``higher_order`` (the CPU paths), the JVP (out, out_dot, lse) and double backward (q, k, v, do grads)."""
    a = dict(_inputs(dtype))
    if zero_padding_do:
        a["do"] = _padding_do(dtype)
    names = ("q", "k", "v", "do", "mask") + (("q_dot", "k_dot", "v_dot") if higher_order else ())
    result = _vm(dtype, kernels, higher_order)["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a[n])) for n in names])
    return [_f64(x) for x in flatten(result)]


PATHS = ("tuned", "decomposed", EXPANDED, CUDA_EMULATED)


# ---- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_keeps_finite_biases_finite(dtype, kernels):
    out, lse = _run(dtype, kernels, False)[:2]
    want, want_lse = _torch_forward(dtype)
    assert_close(out, want, dtype, what=f"out ({kernels})")
    a = _inputs(dtype)
    mask, v = _f64(a["mask"]), _f64(a["v"])
    for b in range(B):
        for row in (0, 4, 6):  # every visible key at one huge value: the mean of their values, or 0
            keys = mask[b, 0, row] == mask[b, 0, row].max()
            if -HUGE <= mask[b, 0, row].max():  # float16's finfo.min: an ordinary bias
                continue
            for h in range(HQ):
                values = v[b, h // (HQ // HKV)][keys]
                mean = values.mean(axis=0) if np.isfinite(mask[b, 0, row].max()) else np.zeros(D)
                assert_close(out[b, h, row], mean, dtype, what=f"batch {b} row {row} head {h} ({kernels})")
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse)) and np.isfinite(lse[~np.isneginf(lse)]).all()
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_agrees_with_pytorch(dtype, kernels):
    """Rows of huge biases get no output gradient (padding): every gradient as PyTorch's."""
    grads = _run(dtype, kernels, True)[2:5]
    for name, got, want in zip(("dq", "dk", "dv"), grads, _torch_backward(dtype)):
        assert_close(got, want, dtype, scale=4, what=f"{name} ({kernels})")


@pytest.mark.parametrize("kernels", ("tuned", CUDA_EMULATED, EXPANDED))
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_of_rows_of_huge_biases(dtype, kernels):
    """With an output gradient on those rows too, finite on every path: the kernels as the floor
    (P from the lse on both), the expansion (the softmax of whole rows) as PyTorch's math."""
    want = _torch_backward(dtype, False) if kernels == EXPANDED else _run(dtype, "decomposed", False)[2:5]
    for name, got, expected in zip(("dq", "dk", "dv"), _run(dtype, kernels, False)[2:5], want):
        assert np.isfinite(got).all(), f"{name} ({kernels})"
        assert_close(got, expected, dtype, scale=4, what=f"{name} ({kernels})")


@pytest.mark.slow  # 8 s a dtype over every path (a quick run: the forward and backward here)
@pytest.mark.parametrize("dtype", DTYPES)
def test_higher_order_kernels_keep_finite_biases_finite(dtype):
    """The JVP against PyTorch's forward mode; the double backward, kernel against floor."""
    want_out, want_dot = _torch_jvp(dtype)
    _, want_lse = _torch_forward(dtype)
    tuned, floor = _run(dtype, "tuned", higher_order=True), _run(dtype, "decomposed", higher_order=True)
    for outputs, kernels in ((tuned, "tuned"), (floor, "decomposed")):
        out, out_dot, lse = outputs[:3]
        assert_close(out, want_out, dtype, what=f"jvp out ({kernels})")
        assert_close(out_dot, want_dot, dtype, scale=4, what=f"jvp out_dot ({kernels})")
        finite = np.isfinite(want_lse)
        assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
        np.testing.assert_allclose(lse[finite], want_lse[finite], atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])
    for name, got, want in zip(("q_grad", "k_grad", "v_grad", "do_grad"), tuned[3:7], floor[3:7]):
        assert np.isfinite(got).all(), name
        # per row, against the row's largest value: on rows of huge biases the terms are about n^2
        # times the usual, and their float32 rounding with them
        atol, rtol = (4 * x for x in TOLERANCE[dtype])
        bound = atol + rtol * np.abs(want).max(axis=-1, keepdims=True)
        assert (np.abs(got - want) <= bound).all(), f"double backward {name} (tuned vs the floor): " \
            f"{np.abs(got - want).max()} at {np.unravel_index(np.argmax(np.abs(got - want) - bound), got.shape)}"
