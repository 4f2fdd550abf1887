"""Which dims of a fuel op's arguments must agree: the contract type inference proves where it
can and the run-time check (``tvm_fuel.op.legalize``) enforces where it cannot.

Shapes: q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D]; do, out [B, Hq, Sq, D]; lse [B, Hq, Sq];
alibi_slopes, sinks [Hq]; paged caches [num_blocks, block_size, Hkv, D], their scales [], [Hkv] or
[num_blocks, block_size, Hkv]; block_table [B, max_blocks];
context_lens [B]; varlen q, do, out [total_q, Hq, D], k, v [total_k, Hkv, D], cu_seqlens [B + 1],
lse [Hq, total_q]; the norms' backward dy, x [N, C], gamma / weight [C], mean, rstd [N]; the
tangents and cotangents q_dot, dq_bar like q, k_dot, v_dot, dk_bar, dv_bar like k.

Contents:
    DimRule       -- ``arg.shape[axis] == ref.shape[ref_axis]``
    dim_rules     -- the rules of one op
    positive_dims -- the dims of one op that must be >= 1 (divisors and the head dim)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DimRule:
    """``arg.shape[axis]`` must equal ``ref.shape[ref_axis]``; ``what`` is the dim's meaning."""

    arg: str
    axis: int
    ref: str
    ref_axis: int
    what: str

    def message(self, op: str) -> str:
        return (f"{op}: the {self.what} of {self.arg!r} ({self.arg}.shape[{self.axis}]) must equal that of "
                f"{self.ref!r} ({self.ref}.shape[{self.ref_axis}])")


def _same(arg: str, ref: str, axes_and_meanings) -> tuple[DimRule, ...]:
    return tuple(DimRule(arg, axis, ref, axis, what) for axis, what in axes_and_meanings)


_QUERY = ((0, "batch B"), (1, "head count Hq"), (2, "query length Sq"), (3, "head dim D"))
_DENSE = (
    DimRule("k", 0, "q", 0, "batch B"), DimRule("k", 3, "q", 3, "head dim D"),
    *_same("v", "k", ((0, "batch B"), (1, "head count Hkv"), (2, "key length Sk"))),
    DimRule("v", 3, "q", 3, "head dim D"),
    DimRule("alibi_slopes", 0, "q", 1, "head count Hq"),
)
_SINKS = (DimRule("sinks", 0, "q", 1, "head count Hq"),)
_BACKWARD = _DENSE + _same("do", "q", _QUERY) + _same("out", "q", _QUERY) + _same("lse", "q", _QUERY[:3])
_KEY = ((0, "batch B"), (1, "head count Hkv"), (2, "key length Sk"), (3, "head dim D"))
_JVP = _DENSE + _same("q_dot", "q", _QUERY) + _same("k_dot", "k", _KEY) + _same("v_dot", "k", _KEY)
_DOUBLE_BACKWARD = (_BACKWARD + _same("dq_bar", "q", _QUERY) + _same("dk_bar", "k", _KEY)
                    + _same("dv_bar", "k", _KEY))
_PAGED = (
    *_same("v_cache", "k_cache", ((0, "block count num_blocks"), (1, "block size"), (2, "head count Hkv"),
                                  (3, "head dim D"))),
    DimRule("k_cache", 3, "q", 3, "head dim D"),
    DimRule("block_table", 0, "q", 0, "batch B"),
    DimRule("context_lens", 0, "q", 0, "batch B"),
    DimRule("alibi_slopes", 0, "q", 1, "head count Hq"),
) + _SINKS

_PACKED_QUERY = ((0, "query count total_q"), (1, "head count Hq"), (2, "head dim D"))
_VARLEN = (
    DimRule("k", 2, "q", 2, "head dim D"),
    *_same("v", "k", ((0, "key count total_k"), (1, "head count Hkv"), (2, "head dim D"))),
    DimRule("cu_seqlens_k", 0, "cu_seqlens_q", 0, "offset count B + 1"),
    DimRule("alibi_slopes", 0, "q", 1, "head count Hq"),
) + _SINKS
_VARLEN_BACKWARD = _VARLEN + _same("do", "q", _PACKED_QUERY) + _same("out", "q", _PACKED_QUERY) + (
    DimRule("lse", 0, "q", 1, "head count Hq"), DimRule("lse", 1, "q", 0, "query count total_q"))

_NORM = (DimRule("dy", 0, "x", 0, "row count N"), DimRule("dy", 1, "x", 1, "feature count C"),
         DimRule("rstd", 0, "x", 0, "row count N"))
_LAYER_NORM = _NORM + (DimRule("gamma", 0, "x", 1, "feature count C"), DimRule("mean", 0, "x", 0, "row count N"))
_RMS_NORM = _NORM + (DimRule("weight", 0, "x", 1, "feature count C"),)

_RULES = {"flash_attn": _DENSE + _SINKS, "flash_attn_backward": _BACKWARD + _SINKS,
          "flash_attn_backward_q": _BACKWARD + _SINKS, "flash_attn_backward_k": _BACKWARD + _SINKS,
          "flash_attn_backward_v": _BACKWARD + _SINKS, "paged_attn": _PAGED,
          "flash_attn_jvp": _JVP, "flash_attn_double_backward": _DOUBLE_BACKWARD,
          "flash_attn_varlen": _VARLEN, "flash_attn_varlen_backward": _VARLEN_BACKWARD,
          "layer_norm_backward": _LAYER_NORM, "rms_norm_backward": _RMS_NORM}


_CACHE_DIMS = ((0, "block count num_blocks"), (1, "block size"), (2, "head count Hkv"))


def dim_rules(op: str, ndim: int = 0, *, scale_ndim: int = 0) -> tuple[DimRule, ...]:
    """The rules of ``op``; softmax_backward's ``dprobs`` has every dim of its ``ndim``-D ``probs``;
    paged_attn's k_scale and v_scale, ``scale_ndim``-D: [Hkv] (fp8) or [num_blocks, block_size,
    Hkv] (int8) of the cache."""
    if op == "softmax_backward":
        return tuple(DimRule("dprobs", axis, "probs", axis, f"dim {axis}") for axis in range(ndim))
    if op == "paged_attn" and scale_ndim in (1, 3):
        cache_dims = _CACHE_DIMS[3 - scale_ndim:]
        return _RULES[op] + tuple(DimRule(name, axis, "k_cache", cache_axis, what) for name in ("k_scale", "v_scale")
                                  for axis, (cache_axis, what) in enumerate(cache_dims))
    return _RULES[op]


_DENSE_POSITIVE = (("q", 1, "head count Hq"), ("q", 3, "head dim D"), ("k", 1, "head count Hkv"))
_POSITIVE = {"paged_attn": (("q", 1, "head count Hq"), ("q", 3, "head dim D"), ("k_cache", 1, "block size"),
                            ("k_cache", 2, "head count Hkv")), "softmax_backward": (),
             **{name: (("q", 1, "head count Hq"), ("q", 2, "head dim D"), ("k", 1, "head count Hkv"),
                       ("cu_seqlens_q", 0, "offset count B + 1")) for name in ("flash_attn_varlen",
                                                                              "flash_attn_varlen_backward")},
             # a row's mean over C features divides by C
             "layer_norm_backward": (("x", 1, "feature count C"),), "rms_norm_backward": (("x", 1, "feature count C"),)}


def positive_dims(op: str) -> tuple[tuple[str, int, str], ...]:
    """(arg, axis, meaning) of the dims of ``op`` that must be >= 1: the GQA group and the block
    size divide, the softmax scale is 1 / sqrt(D). (An empty cache, num_blocks = 0, is valid while
    every context is empty.)"""
    return _POSITIVE.get(op, _DENSE_POSITIVE)
