"""Type inference of the fuel ops: result types (static and symbolic) and every rejection."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax, tirx
from tvm.ir import TupleType

from tvm_fuel import op

pytestmark = pytest.mark.unit


def _var(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(shape, dtype))


def _infer(call):
    bb = relax.BlockBuilder()
    return bb.normalize(call).ty


def _qkv(Hq=8, Hkv=2, Sq=17, Sk=97, D=64, dtype="float32", B=2):
    return _var("q", (B, Hq, Sq, D), dtype), _var("k", (B, Hkv, Sk, D), dtype), _var("v", (B, Hkv, Sk, D), dtype)


def _paged(**over):
    args = dict(q=_var("q", (4, 8, 1, 64)), k_cache=_var("kc", (32, 16, 2, 64)), v_cache=_var("vc", (32, 16, 2, 64)),
                block_table=_var("bt", (4, 8), "int32"), context_lens=_var("cl", (4,), "int32"))
    args.update(over)
    return args


def test_flash_attn_infer_ty():
    q, k, v = _qkv(dtype="float16")
    tvm.ir.assert_structural_equal(_infer(op.flash_attn(q, k, v)), relax.TensorType((2, 8, 17, 64), "float16"))
    tvm.ir.assert_structural_equal(
        _infer(op.flash_attn(q, k, v, return_lse=True)),
        TupleType([relax.TensorType((2, 8, 17, 64), "float16"), relax.TensorType((2, 8, 17), "float32")]))


def test_flash_attn_infer_ty_shape_symbolic():
    b, sq, sk = tirx.Var("b", "int64"), tirx.Var("sq", "int64"), tirx.Var("sk", "int64")
    q, k, v = _var("q", (b, 8, sq, 64)), _var("k", (b, 2, sk, 64)), _var("v", (b, 2, sk, 64))
    mask = _var("m", (sq, sk), "bool")
    ty = _infer(op.flash_attn(q, k, v, attn_mask=mask, return_lse=True))
    tvm.ir.assert_structural_equal(ty.fields[1], relax.TensorType((b, 8, sq), "float32"))


def test_flash_attn_infer_ty_unknown_shape_keeps_rank():
    q = relax.Var("q", relax.TensorType(ndim=4, dtype="float32"))
    _, k, v = _qkv()
    tvm.ir.assert_structural_equal(_infer(op.flash_attn(q, k, v)), relax.TensorType(ndim=4, dtype="float32"))


def test_backward_infer_ty():
    q, k, v = _qkv(dtype="bfloat16")
    do = _var("do", (2, 8, 17, 64), "bfloat16")
    ty = _infer(op.flash_attn_backward(q, k, v, do))
    tvm.ir.assert_structural_equal(ty, TupleType([q.ty, k.ty, v.ty]))
    tvm.ir.assert_structural_equal(_infer(op.flash_attn_backward_k(q, k, v, do)), k.ty)
    tvm.ir.assert_structural_equal(_infer(op.flash_attn_backward_v(q, k, v, do)), v.ty)
    tvm.ir.assert_structural_equal(_infer(op.flash_attn_backward_q(q, k, v, do)), q.ty)


def test_paged_attn_and_softmax_backward_infer_ty():
    tvm.ir.assert_structural_equal(_infer(op.paged_attn(**_paged())), relax.TensorType((4, 8, 1, 64), "float32"))
    p = _var("p", (2, 3, 5), "float16")
    tvm.ir.assert_structural_equal(_infer(op.softmax_backward(p, _var("dp", (2, 3, 5), "float16"))), p.ty)


BAD_FLASH = [
    ("q rank", lambda: op.flash_attn(_var("q", (2, 8, 64)), *_qkv()[1:]),
     ValueError, r"fuel\.flash_attn: argument 'q' must be 4-D \[B, Hq, Sq, D\], got a 3-D tensor"),
    ("k rank", lambda: op.flash_attn(_qkv()[0], _var("k", (2, 2, 97, 64, 1)), _qkv()[2]),
     ValueError, r"fuel\.flash_attn: argument 'k' must be 4-D \[B, Hkv, Sk, D\]"),
    ("gqa", lambda: op.flash_attn(*_qkv(Hq=6, Hkv=4)),
     ValueError, r"fuel\.flash_attn: Hq \(6\) must be a multiple of Hkv \(4\) of argument 'k'"),
    ("head dim", lambda: op.flash_attn(_qkv()[0], _var("k", (2, 2, 97, 32)), _var("v", (2, 2, 97, 32))),
     ValueError, r"fuel\.flash_attn: head dim D of 'k' \(32\) must equal that of 'q' \(64\)"),
    ("v length", lambda: op.flash_attn(*_qkv()[:2], _var("v", (2, 2, 96, 64))),
     ValueError, r"fuel\.flash_attn: key length Sk of 'v' \(96\) must equal that of 'k' \(97\)"),
    ("v head dim", lambda: op.flash_attn(*_qkv()[:2], _var("v", (2, 2, 97, 32))),
     ValueError, r"fuel\.flash_attn: head dim D of 'v' \(32\) must equal that of 'q' \(64\)"),
    ("batch", lambda: op.flash_attn(_qkv()[0], *_qkv(B=3)[1:]),
     ValueError, r"fuel\.flash_attn: batch B of 'k' \(3\) must equal that of 'q' \(2\)"),
    ("mixed dtype", lambda: op.flash_attn(_qkv()[0], *_qkv(dtype="float16")[1:]),
     TypeError, r"fuel\.flash_attn: argument 'k' must have the dtype of 'q' \(float32\), got float16"),
    ("int q", lambda: op.flash_attn(_var("q", (2, 8, 17, 64), "int32"), *_qkv()[1:]),
     TypeError, r"fuel\.flash_attn: argument 'q' must have dtype float32 or float16 or bfloat16, got int32"),
    ("alibi length", lambda: op.flash_attn(*_qkv(), alibi_slopes=_var("s", (6,))),
     ValueError, r"fuel\.flash_attn: argument 'alibi_slopes' must have shape \[Hq\] = \[8\], got \[6\]"),
    ("alibi dtype", lambda: op.flash_attn(*_qkv(), alibi_slopes=_var("s", (8,), "float16")),
     TypeError, r"fuel\.flash_attn: argument 'alibi_slopes' must have dtype float32, got float16"),
    ("mask broadcast", lambda: op.flash_attn(*_qkv(), attn_mask=_var("m", (2, 8, 17, 96), "bool")),
     ValueError, r"fuel\.flash_attn: argument 'attn_mask' of shape \[2, 8, 17, 96\] does not broadcast to "
                 r"\[B, Hq, Sq, Sk\] = \[2, 8, 17, 97\]"),
    ("mask rank", lambda: op.flash_attn(*_qkv(), attn_mask=_var("m", (1, 2, 8, 17, 97), "bool")),
     ValueError, r"fuel\.flash_attn: argument 'attn_mask' must have 1 to 4 dims, broadcastable to \[B, Hq, Sq, Sk\], "
                 r"got 5 dims"),
    ("scalar mask", lambda: op.flash_attn(*_qkv(), attn_mask=_var("m", (), "float32")),
     ValueError, r"fuel\.flash_attn: argument 'attn_mask' must have 1 to 4 dims, .* got 0 dims"),
    ("mask dtype", lambda: op.flash_attn(*_qkv(), attn_mask=_var("m", (17, 97), "int8")),
     TypeError, r"fuel\.flash_attn: argument 'attn_mask' must have dtype bool or float32"),
    ("window", lambda: op.flash_attn(*_qkv(), window_size=(-2, 0)),
     ValueError, r"fuel\.flash_attn: window_size left must be -1 \(unbounded\) or >= 0, got -2"),
    ("window right", lambda: op.flash_attn(*_qkv(), window_size=(3, -5)),
     ValueError, r"fuel\.flash_attn: window_size right must be -1 \(unbounded\) or >= 0, got -5"),
    ("window pair", lambda: op.flash_attn(*_qkv(), window_size=(3,)),
     ValueError, r"fuel\.flash_attn: window_size must be a pair \(left, right\)"),
    ("softcap", lambda: op.flash_attn(*_qkv(), softcap=-1.0),
     ValueError, r"fuel\.flash_attn: softcap must be >= 0 \(0 disables it\), got -1\.0"),
    ("scale", lambda: op.flash_attn(*_qkv(), softmax_scale=float("nan")),
     ValueError, r"fuel\.flash_attn: softmax_scale must be finite and non-zero"),
    ("not an expr", lambda: op.flash_attn(*_qkv()[:2], [1, 2]),
     TypeError, r"fuel\.flash_attn: argument 'v' must be a Relax expression, got list"),
]


@pytest.mark.parametrize("make,error,message", [case[1:] for case in BAD_FLASH], ids=[c[0] for c in BAD_FLASH])
def test_flash_attn_rejects(make, error, message):
    with pytest.raises(error, match=message):
        _infer(make())


def _do(shape=(2, 8, 17, 64), dtype="float32"):
    return _var("do", shape, dtype)


BAD_BACKWARD = [
    ("do shape", lambda: op.flash_attn_backward(*_qkv(), _do((2, 8, 16, 64))),
     ValueError, r"fuel\.flash_attn_backward: argument 'do' must have shape \[B, Hq, Sq, D\] of q = "
                 r"\[2, 8, 17, 64\], got \[2, 8, 16, 64\]"),
    ("do dtype", lambda: op.flash_attn_backward(*_qkv(), _do(dtype="float16")),
     TypeError, r"fuel\.flash_attn_backward: argument 'do' must have the dtype of 'q' \(float32\), got float16"),
    ("lse shape", lambda: op.flash_attn_backward(*_qkv(), _do(), lse=_var("lse", (2, 8, 16))),
     ValueError, r"fuel\.flash_attn_backward: argument 'lse' must have shape \[B, Hq, Sq\] of q"),
    ("lse dtype", lambda: op.flash_attn_backward(*_qkv(), _do(), lse=_var("lse", (2, 8, 17), "float16")),
     TypeError, r"fuel\.flash_attn_backward: argument 'lse' must have dtype float32, got float16"),
    ("out shape", lambda: op.flash_attn_backward_q(*_qkv(), _do(), out=_var("o", (2, 8, 17, 32))),
     ValueError, r"fuel\.flash_attn_backward_q: argument 'out' must have shape \[B, Hq, Sq, D\] of q"),
    ("gqa", lambda: op.flash_attn_backward_k(*_qkv(Hq=7, Hkv=2), _do((2, 7, 17, 64))),
     ValueError, r"fuel\.flash_attn_backward_k: Hq \(7\) must be a multiple of Hkv \(2\)"),
]


@pytest.mark.parametrize("make,error,message", [case[1:] for case in BAD_BACKWARD],
                         ids=[c[0] for c in BAD_BACKWARD])
def test_flash_attn_backward_rejects(make, error, message):
    with pytest.raises(error, match=message):
        _infer(make())


BAD_PAGED = [
    ("table dtype", dict(block_table=_var("bt", (4, 8), "float32")),
     TypeError, r"fuel\.paged_attn: argument 'block_table' must have dtype int32 or uint32 or int64, got float32"),
    ("lens dtype", dict(context_lens=_var("cl", (4,), "float16")),
     TypeError, r"fuel\.paged_attn: argument 'context_lens' must have dtype int32 or uint32 or int64"),
    ("table rank", dict(block_table=_var("bt", (4,), "int32")),
     ValueError, r"fuel\.paged_attn: argument 'block_table' must be 2-D \[B, max_blocks\]"),
    ("table batch", dict(block_table=_var("bt", (3, 8), "int32")),
     ValueError, r"fuel\.paged_attn: batch B of 'block_table' \(3\) must equal that of 'q' \(4\)"),
    ("lens batch", dict(context_lens=_var("cl", (5,), "int32")),
     ValueError, r"fuel\.paged_attn: argument 'context_lens' must have shape \[B\] = \[4\], got \[5\]"),
    ("cache mismatch", dict(v_cache=_var("vc", (32, 8, 2, 64))),
     ValueError, r"fuel\.paged_attn: argument 'v_cache' must have shape \[num_blocks, block_size, Hkv, D\] of "
                 r"k_cache = \[32, 16, 2, 64\], got \[32, 8, 2, 64\]"),
    ("cache rank", dict(k_cache=_var("kc", (32, 16, 128))),
     ValueError, r"fuel\.paged_attn: argument 'k_cache' must be 4-D \[num_blocks, block_size, Hkv, D\]"),
    ("cache dtype", dict(k_cache=_var("kc", (32, 16, 2, 64), "float16")),
     TypeError, r"fuel\.paged_attn: argument 'k_cache' must have the dtype of 'q' \(float32\), got float16"),
    ("head dim", dict(k_cache=_var("kc", (32, 16, 2, 32)), v_cache=_var("vc", (32, 16, 2, 32))),
     ValueError, r"fuel\.paged_attn: head dim D of 'k_cache' \(32\) must equal that of 'q' \(64\)"),
    ("gqa", dict(k_cache=_var("kc", (32, 16, 3, 64)), v_cache=_var("vc", (32, 16, 3, 64))),
     ValueError, r"fuel\.paged_attn: Hq \(8\) must be a multiple of Hkv \(3\) of argument 'k_cache'"),
    ("alibi", dict(alibi_slopes=_var("s", (4,))),
     ValueError, r"fuel\.paged_attn: argument 'alibi_slopes' must have shape \[Hq\] = \[8\], got \[4\]"),
]


@pytest.mark.parametrize("over,error,message", [case[1:] for case in BAD_PAGED], ids=[c[0] for c in BAD_PAGED])
def test_paged_attn_rejects(over, error, message):
    with pytest.raises(error, match=message):
        _infer(op.paged_attn(**_paged(**over)))


def test_paged_attn_rejects_bad_options():
    with pytest.raises(ValueError, match=r"fuel\.paged_attn: softcap must be >= 0"):
        op.paged_attn(**_paged(), softcap=-0.5)
    with pytest.raises(ValueError, match=r"fuel\.paged_attn: window_size left must be -1"):
        op.paged_attn(**_paged(), window_size=(-3, -1))


def test_softmax_backward_rejects():
    p = _var("p", (2, 3, 5))
    with pytest.raises(ValueError, match=r"fuel\.softmax_backward: argument 'dprobs' must have shape the shape of "
                                         r"'probs' = \[2, 3, 5\], got \[2, 3, 4\]"):
        _infer(op.softmax_backward(p, _var("dp", (2, 3, 4))))
    with pytest.raises(TypeError, match=r"fuel\.softmax_backward: argument 'dprobs' must have the dtype of 'probs'"):
        _infer(op.softmax_backward(p, _var("dp", (2, 3, 5), "float16")))
    with pytest.raises(ValueError, match=r"fuel\.softmax_backward: axis 3 is out of range for a 3-D 'probs'"):
        _infer(op.softmax_backward(p, _var("dp", (2, 3, 5)), axis=3))


def test_symbolic_mask_dims_and_heads_must_be_provable():
    """A mask dim that might be 1 or full at run time, and heads whose group is not provable, are
    rejected: the kernels would index them out of bounds."""
    n = tirx.Var("n", "int64")
    with pytest.raises(ValueError, match=r"fuel\.flash_attn: argument 'attn_mask' of shape \[n, 97\] does not "
                                         r"broadcast .* \(each dim must be 1 or equal the full dim\)"):
        _infer(op.flash_attn(*_qkv(), attn_mask=_var("m", (n, 97), "bool")))
    hq, hkv = tirx.Var("hq", "int64"), tirx.Var("hkv", "int64")
    q, k, v = _var("q", (2, hq, 17, 64)), _var("k", (2, hkv, 97, 64)), _var("v", (2, hkv, 97, 64))
    with pytest.raises(ValueError, match=r"fuel\.flash_attn: Hq \(hq\) must be provably a multiple of Hkv \(hkv\)"):
        _infer(op.flash_attn(q, k, v))
    k1, v1 = _var("k", (2, 1, 97, 64)), _var("v", (2, 1, 97, 64))
    tvm.ir.assert_structural_equal(_infer(op.flash_attn(q, k1, v1)), relax.TensorType((2, hq, 17, 64), "float32"))


def test_options_are_keyword_only():
    q, k, v = _qkv()
    with pytest.raises(TypeError):
        op.flash_attn(q, k, v, None, None, 0.5)  # softmax_scale passed positionally
