"""Quantized KV caches: the 8-bit element formats, written once on TIR expressions.

A cache element ``x`` stands for ``decode(x) * scale``:

* ``float8_e4m3fn`` / ``float8_e5m2`` (vLLM's fp8 caches): ``scale`` is ``k_scale`` / ``v_scale``,
  a float32 scalar or one per KV head ([Hkv]), fixed for the cache (vLLM's convention);
* ``int8``: ``scale`` is float32 per (block, token, KV head) ([num_blocks, block_size, Hkv]),
  set by ``encode_int8``'s rule when a token is written.

Why not TVM's own casts: TVM 0.27's LLVM lowering of a float8 -> float32 cast is wrong for zero and
the subnormals (0 -> 2^-7 in e4m3fn) and for e5m2's Inf and NaN, so the kernels and the floor
decode the bits themselves, through float16 (whose conversion to float32 is one instruction on
x86's F16C and CUDA): e5m2 is a float16's top byte; e4m3fn's bits, one place lower, are a float16
of 2^-8 times its value, exact for normals and subnormals alike, its NaN code patched by integer
arithmetic (no select: CUDA's codegen holds no vector of bools). A streaming decode spends most of
its instructions on these per-element decodes, so the kernels fold the 2^8 into each token's scale
(``decode_parts``).

The encode side (``encode_fp8``, ``encode_int8``) rounds to nearest, ties to even, and saturates
(vLLM's and FlashInfer's rule): a finite value past the format's largest is stored as the
largest, NaN stays NaN (int8: a row holding NaN gets a NaN scale, one holding Inf an Inf scale,
and codes 0: either reads back NaN).

Contents:
    QUANT_DTYPES        -- the quantized cache dtypes
    FP8_MAX, INT8_MAX   -- the formats' largest finite magnitudes
    is_fp8              -- whether a dtype is one of the fp8 formats
    scale_at            -- the scale of a token's head, whichever form the scales take
    decode              -- a quantized element (loaded from its buffer) as float32, before its scale
    decode_parts, decode_factor -- the same up to a constant factor (folded into a scale by the kernels)
    encode_fp8          -- float32 -> the fp8 element (round to nearest even, saturating)
    encode_int8         -- float32 (already divided by the token's scale) -> int8
    int8_scale          -- the int8 scale rule: max |x| of a token's head row / 127
"""

from __future__ import annotations

from tvm import tirx

QUANT_DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8")
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
INT8_MAX = 127

# per fp8 format: mantissa bits, exponent bias, the largest finite code, a NaN code
_FP8 = {"float8_e4m3fn": (3, 7, 0x7E, 0x7F), "float8_e5m2": (2, 15, 0x7B, 0x7E)}
_F32_MANTISSA = 23
_F32_BIAS = 127


def is_fp8(dtype: str) -> bool:
    return str(dtype) in _FP8


def _u32(value: int):
    return tirx.const(value, "uint32")


def _u16(value: int):
    return tirx.const(value, "uint16")


def scale_at(scale, block, slot, g):
    """The element of a cache's ``scale`` ([], [Hkv] or [num_blocks, block_size, Hkv]) that scales
    its token at (block, slot) of KV head g."""
    return scale[(block, slot, g)[3 - len(scale.shape):]]


def decode(x):
    """The float32 value of the quantized element ``x`` (a load of a float8 or int8 buffer), before
    its scale; any other dtype is cast."""
    value, factor = decode_parts(x)
    return value if factor == 1 else value * tirx.const(factor, "float32")


def decode_factor(dtype: str) -> float:
    """The constant factor of ``decode_parts`` for elements of ``dtype``."""
    return 256.0 if str(dtype) == "float8_e4m3fn" else 1.0


def decode_parts(x) -> tuple:
    """``(value, factor)``: ``x`` decoded up to a constant power of two (``decode(x)`` is
    ``value * factor``), for kernels that fold ``factor`` into the element's scale."""
    dtype = str(x.ty)
    if dtype not in _FP8:
        return x.astype("float32"), decode_factor(dtype)
    # e5m2 is the top byte of a float16; e4m3fn's bits shifted one less, the sign moved to bit 15,
    # are a float16 of 2^-8 times its value (subnormals included): the hardware's float16 ->
    # float32 conversion does the rest (x86 F16C, CUDA's cvt), cheaper than building float32 bits
    bits = tirx.reinterpret("uint8", x)
    if dtype == "float8_e5m2":  # Inf and NaN map to float16's
        return tirx.reinterpret("float16", tirx.Cast("uint16", bits) << _u16(8)).astype("float32"), decode_factor(dtype)
    # sign-extended (through int8) then shifted: bit 14 holds a copy of the sign, which must end 0
    # (the exponent's top bit), and e4m3fn's 0x7F (NaN; no Inf), float16 1.875 here, needs its
    # exponent all ones. Bit 14 of (half + 0x80) is the bit to flip for both: the sign copy of every
    # negative non-NaN, and the positive NaN's carry out of bits 7..13; the negative NaN's carry
    # clears it, leaving that NaN's bit 14 set. Integer arithmetic, no select (vector selects make
    # bool vectors, which CUDA's codegen cannot hold), and three operations, paid per element
    half = tirx.reinterpret("uint16", tirx.Cast("int16", tirx.reinterpret("int8", bits))) << _u16(7)
    half = half ^ ((half + _u16(0x80)) & _u16(0x4000))
    return tirx.reinterpret("float16", half).astype("float32"), decode_factor(dtype)


def encode_fp8(x, dtype: str):
    """The ``dtype`` (fp8) element nearest the float32 ``x`` (ties to even), saturated to +-FP8_MAX;
    NaN stays NaN."""
    mantissa, bias, largest, nan = _FP8[dtype]
    bits = tirx.reinterpret("uint32", x)
    sign = (bits >> _u32(24)) & _u32(0x80)
    magnitude = tirx.reinterpret("float32", bits & _u32(0x7FFFFFFF))
    drop = _F32_MANTISSA - mantissa
    # normals: float32's mantissa rounded to the format's (ties to even; a carry bumps the exponent)
    rounded = (bits & _u32(0x7FFFFFFF)) + _u32((1 << (drop - 1)) - 1) + (((bits & _u32(0x7FFFFFFF)) >> _u32(drop))
                                                                         & _u32(1))
    normal = (rounded >> _u32(drop)) - _u32((_F32_BIAS - bias) << mantissa)
    # subnormals (below 2^(1 - bias)): the count of 2^(1 - bias - mantissa) units, rounded to even
    unit = 2.0 ** (1 - bias - mantissa)
    sub = tirx.Cast("uint32", tirx.nearbyint(magnitude * tirx.const(1.0 / unit, "float32")))
    small = magnitude < tirx.const(2.0 ** (1 - bias), "float32")
    code = tirx.Select(small, sub, tirx.min(normal, _u32(largest)))
    code = tirx.Select(magnitude > tirx.const(FP8_MAX[dtype], "float32"), _u32(largest), code)
    # NaN by its bits: a float self-compare is folded away
    code = tirx.Select((bits & _u32(0x7FFFFFFF)) > _u32(0x7F800000), _u32(nan), code)
    return tirx.reinterpret(dtype, tirx.Cast("uint8", code | sign))


def encode_int8(x):
    """The int8 element of ``x`` (the value divided by its token's scale): rounded to nearest even,
    clamped to [-127, 127] (NaN: 0, its scale carries the NaN)."""
    clamped = tirx.max(tirx.min(tirx.nearbyint(x), tirx.const(float(INT8_MAX), "float32")),
                       tirx.const(-float(INT8_MAX), "float32"))
    nan = (tirx.reinterpret("uint32", x) & _u32(0x7FFFFFFF)) > _u32(0x7F800000)
    return tirx.Cast("int8", tirx.Select(nan, tirx.const(0.0, "float32"), clamped))


def int8_scale(absmax):
    """The int8 scale of a token's head row whose largest magnitude is ``absmax`` (float32)."""
    return absmax * tirx.const(1.0 / INT8_MAX, "float32")


__all__ = ["QUANT_DTYPES", "FP8_MAX", "INT8_MAX", "is_fp8", "scale_at", "decode", "decode_parts", "decode_factor",
           "encode_fp8", "encode_int8", "int8_scale"]
