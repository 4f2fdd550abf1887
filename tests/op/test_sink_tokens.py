"""StreamingLLM's sink tokens (``sink_tokens = n``: keys ``j < n`` stay visible past the window's
left bound) on flash_attn, its backward, paged_attn, the JVP and the double backward: the floor, the
CPU kernels and the CUDA kernels' emulation against the float64 reference; the reference against
an explicit keep mask; ExpandAttention; the option's errors, printing and tuning keys."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import BLOCK, CUDA_EMULATED, HOST, Runner, assert_close, build, dense_inputs, paged_inputs, run
from tvm import relax

import tvm_fuel
from tvm_fuel import op
from tvm_fuel import reference as ref
from tvm_fuel.schedules.workload import Workload
from tvm_fuel.transform.expand_attention import ExpandAttention

pytestmark = pytest.mark.numerics

# a window far shorter than the keys, with sink tokens inside one key tile, spanning tiles, and
# past every key; with a causal diagonal, a two-sided window, and no right bound
OPTIONS = {
    "causal_4": dict(causal=True, window_size=(8, -1), sink_tokens=4),
    "causal_40": dict(causal=True, window_size=(16, -1), sink_tokens=40),
    "two_sided_1": dict(window_size=(5, 3), sink_tokens=1),
    "left_only_200": dict(window_size=(6, -1), sink_tokens=200),
}


def test_reference_keeps_the_first_keys_past_the_window():
    """visible_keys with sink tokens is the window's mask or'd with j < n, within the right bound
    and the length: built here from its definition."""
    sq, sk, kv_len, n = 7, 40, 37, 5
    i = np.arange(sq)[:, None] + kv_len - sq
    j = np.arange(sk)[None, :]
    want = (j < kv_len) & (j <= i + 2) & ((j >= i - 3) | (j < n))
    np.testing.assert_array_equal(ref.visible_keys(sq, sk, kv_len, window_size=(3, 2), sink_tokens=n), want)
    np.testing.assert_array_equal(ref.visible_keys(sq, sk, kv_len, window_size=(-1, 2), sink_tokens=n),
                                  ref.visible_keys(sq, sk, kv_len, window_size=(-1, 2)))  # no left bound: all seen


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("group,sq,sk", [(1, 17, 97), (3, 97, 97), (7, 1, 97), (3, 5, 0)])
def test_forward(options, group, sq, sk, kernels):
    rng = np.random.default_rng(group * 100 + sq + sk)
    inputs = dense_inputs(rng, 2, 2 * group, 2, sq, sk, 40)
    out, lse = run(lambda **a: op.flash_attn(**a, return_lse=True, **OPTIONS[options]), inputs, kernels=kernels)
    want_out, want_lse = ref.flash_attn(*inputs.values(), return_lse=True, **OPTIONS[options])
    assert_close(out, want_out, "float32", what="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=1e-5, rtol=1e-5)
    # the reference agrees with the same keys kept by an explicit mask
    keep = ref.visible_keys(sq, sk, **OPTIONS[options])
    masked = ref.flash_attn(*inputs.values(), attn_mask=keep)
    np.testing.assert_allclose(want_out, masked, atol=1e-12)


def test_the_walk_skips_the_tiles_between_the_sink_tokens_and_the_window():
    """key_tiles over 400 keys, a window of 16 and 4 sink tokens: rows 300..331 walk the sink
    tokens' tile 0, then the window's tiles 8..10 (32 keys each), and none between."""
    from tvm_fuel.op.config import AttnConfig
    from tvm_fuel.schedules.common import key_tiles

    analyzer = tvm.sym.Analyzer()
    rows = {name: tvm.tirx.const(value, "int64") for name, value in
            dict(first_pos=300, last_pos=331, kv_len=400, delta=0).items()}
    walk = key_tiles(AttnConfig(causal=True, window_size=(16, -1), sink_tokens=4), **rows, block_k=32)
    count = int(analyzer.simplify(walk.count))
    assert [int(analyzer.simplify(walk.tile(tvm.tirx.const(t, "int64")))) for t in range(count)] == [0, 8, 9, 10]
    plain = key_tiles(AttnConfig(causal=True, window_size=(16, -1)), **rows, block_k=32)
    assert isinstance(plain.sinks, int)  # without sink tokens the walk is the window's range as before


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_kernels_bind_the_walk_once(dtype):
    """The CUDA forward and backward kernels with sink tokens are about as large as without (1.09x
    and 1.11x here): the walk's bounds (a Select over the window's min/max expressions) are bound to
    variables once, not inlined at every use of the tile index (2.0x the float32 forward's text and
    1.3x the float16 one's, and 25 s of TVM's simplifier per float32 kernel instead of 1 s)."""
    rng = np.random.default_rng(2)
    inputs = dense_inputs(rng, 1, 6, 2, 64, 200, 40, dtype, with_do=True)
    params = {name: (a.shape, str(a.dtype)) for name, a in inputs.items()}
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    sizes = {}
    for sinks in (0, 4):
        options = dict(causal=True, window_size=(8, -1), sink_tokens=sinks)
        mod = build(lambda **a: op.flash_attn_backward(**a, **options), params)
        mod["forward"] = build(lambda q, k, v, do: op.flash_attn(q, k, v, **options), params)["main"]
        legalized = tvm_fuel.transform.legalize(mod, target, kernels="tuned")
        sizes[sinks] = {gv.name_hint: len(f.script()) for gv, f in legalized.functions.items()
                        if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.startswith("fuel_flash_attn")}
    assert len(sizes[4]) >= 2 and sizes[4].keys() == sizes[0].keys()
    for name, size in sizes[4].items():
        assert size < 1.2 * sizes[0][name], (name, size, sizes[0][name])


@pytest.mark.parametrize("options", ["causal_4", "causal_40"])
def test_long_keys_walk_past_the_gap(options, kernels):
    """400 keys (the CUDA emulation: 200) and a window of 8 or 16: every kernel's walk has tiles
    to skip between the sink tokens and the window, forward and backward."""
    rng = np.random.default_rng(7)
    inputs = dense_inputs(rng, 1, 6, 2, 64, 200 if kernels == CUDA_EMULATED else 400, 40, with_do=True)
    (out,) = run(lambda q, k, v, do: op.flash_attn(q, k, v, **OPTIONS[options]), inputs, kernels=kernels)
    assert_close(out, ref.flash_attn(inputs["q"], inputs["k"], inputs["v"], **OPTIONS[options]), "float32")
    grads = run(lambda **a: op.flash_attn_backward(**a, **OPTIONS[options]), inputs, kernels=kernels)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref.flash_attn_backward(*inputs.values(),
                                                                                 **OPTIONS[options])):
        assert_close(got, want, "float32", scale=4, what=name)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_forward_half_precision_with_alibi(dtype, kernels):
    rng = np.random.default_rng(5)
    inputs = dense_inputs(rng, 1, 6, 2, 33, 130, 64, dtype)
    inputs["alibi_slopes"] = np.linspace(0.01, 0.1, 6).astype(np.float32)
    options = OPTIONS["causal_40"]
    (out,) = run(lambda **a: op.flash_attn(**a, **options), inputs, kernels=kernels)
    assert_close(out, ref.flash_attn(*inputs.values(), **options), dtype, what="out")


@pytest.mark.parametrize("options,group,sq,sk", [("causal_4", 3, 17, 97), ("causal_40", 1, 97, 97),
                                                 ("two_sided_1", 7, 33, 65)])
def test_backward(options, group, sq, sk, kernels):
    rng = np.random.default_rng(group + sq + sk)
    inputs = dense_inputs(rng, 2, 2 * group, 2, sq, sk, 40, with_do=True)
    grads = run(lambda **a: op.flash_attn_backward(**a, **OPTIONS[options]), inputs, kernels=kernels)
    want = ref.flash_attn_backward(*inputs.values(), **OPTIONS[options])
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want):
        assert_close(got, expected, "float32", scale=4, what=name)
    assert np.abs(want[1][:, :, :4]).max() > 1e-3  # the sink tokens' keys get a gradient worth checking


@pytest.mark.parametrize("sq", [1, 3])
def test_paged(sq, kernels):
    """Decode (sq 1: the CPU kernel streams in place) and packed key tiles (3 queries x group 3)."""
    rng = np.random.default_rng(sq)
    longest = 150 if kernels == CUDA_EMULATED else 300  # the emulation runs the device's threads one by one
    inputs = paged_inputs(rng, [0, 1, 17, 70, longest], Sq=sq, num_blocks=40, max_blocks=-(-longest // BLOCK))
    options = dict(causal=True, window_size=(20, -1), sink_tokens=4)
    (out,) = run(lambda **a: op.paged_attn(**a, **options), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(*inputs.values(), **options), "float32", what="out")


@pytest.mark.parametrize("kernels", ["decomposed", "tuned"])
def test_jvp_and_double_backward(kernels):
    """The CPU tangent kernel walks the sink tokens' tiles; the double backward's key tiles see
    every query after them."""
    rng = np.random.default_rng(11)
    inputs = dense_inputs(rng, 1, 6, 2, 33, 97, 40, with_do=True)
    dots = {f"{n}_dot": rng.standard_normal(inputs[n].shape).astype(np.float32) for n in "qkv"}
    options = OPTIONS["causal_4"]
    qkv = {n: inputs[n] for n in "qkv"}
    out, out_dot = run(lambda **a: op.flash_attn_jvp(**a, **options), {**qkv, **dots}, kernels=kernels)
    want = ref.flash_attn_jvp(*qkv.values(), *dots.values(), **options)
    assert_close(out, want[0], "float32", what="out")
    assert_close(out_dot, want[1], "float32", scale=4, what="out_dot")
    bars = {f"d{n}_bar": value for n, value in zip("qkv", dots.values())}
    got = run(lambda **a: op.flash_attn_double_backward(**a, **options), {**inputs, **bars}, kernels=kernels)
    want = ref.flash_attn_double_backward(*inputs.values(), *bars.values(), **options)
    for name, g, w in zip(("q_grad", "k_grad", "v_grad", "do_grad"), got, want):
        assert_close(g, w, "float32", scale=5, what=name)


def test_expand_attention():
    """The expansion keeps the sink tokens' keys (an arange compared with n, or'd into the window)."""
    rng = np.random.default_rng(4)
    inputs = dense_inputs(rng, 1, 6, 2, 17, 97, 40)
    options = OPTIONS["causal_40"]
    mod = build(lambda **a: op.flash_attn(**a, **options), {n: (a.shape, str(a.dtype)) for n, a in inputs.items()})
    expanded = ExpandAttention()(mod)
    assert "fuel" not in expanded.script()
    (out,) = Runner(expanded, HOST)(*inputs.values())
    assert_close(out, ref.flash_attn(*inputs.values(), **options), "float32")


def _var(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(shape, dtype))


@pytest.mark.parametrize("value,error", [(-1, ValueError), (2**31, ValueError), (True, TypeError), (1.5, TypeError)])
def test_bad_sink_tokens(value, error):
    q, k = _var("q", (1, 6, 4, 8)), _var("k", (1, 2, 4, 8))
    with pytest.raises(error, match="fuel.flash_attn: sink_tokens"):
        op.flash_attn(q, k, k, window_size=(2, 0), sink_tokens=value)


def test_printed_calls_parse_back_and_plain_calls_carry_no_sink_tokens():
    q, k = _var("q", (1, 6, 4, 8)), _var("k", (1, 2, 4, 8))
    for make, name in ((lambda: op.flash_attn(q, k, k, window_size=(2, 0), sink_tokens=3), "flash_attn"),
                       (lambda: op.flash_attn_backward(q, k, k, q, window_size=(2, 0), sink_tokens=3),
                        "flash_attn_backward")):
        call = make()
        assert int(call.attrs["sink_tokens"]) == 3 and op.options_of(call)["sink_tokens"] == 3
        bb = relax.BlockBuilder()
        with bb.function("main", [q, k]):
            bb.emit_func_output(bb.emit(call))
        mod = bb.get()
        tvm.ir.assert_structural_equal(tvm.script.from_source(mod.script()), mod)
    assert "sink_tokens" not in op.flash_attn(q, k, k, window_size=(2, 0)).attrs.keys()


def test_tuning_keys():
    """A workload with sink tokens names them and round-trips its key; one without writes the key
    the records before sink tokens hold."""
    mod = build(lambda **a: op.flash_attn(**a, causal=True, window_size=(64, -1), sink_tokens=4),
                dict(q=((1, 8, 256, 64), "float32"), k=((1, 8, 256, 64), "float32"), v=((1, 8, 256, 64), "float32")))
    from tvm_fuel.tuning.kernels import workloads_of

    (workload,) = workloads_of(mod, tvm_fuel.target.as_target(HOST))
    assert workload.spec.cfg.sink_tokens == 4 and "sink_tokens4" in workload.describe()
    assert Workload.from_key(workload.key) == workload
    plain = Workload(workload.op, type(workload.spec)(**{**workload.spec.__dict__, "cfg": type(workload.spec.cfg)(
        causal=True, window_size=(64, -1))}), workload.dims)
    assert "sink_tokens" not in plain.key and Workload.from_key(plain.key) == plain
