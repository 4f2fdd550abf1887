"""Relax constructors of the attention ops (``tvm_fuel.op``).

Each constructor returns a ``relax.Call`` to an operator registered as ``relax.fuel.<name>``, so it
prints as ``R.fuel.<name>(...)``. Type inference lives in ``tvm_fuel.op.infer``, the decomposition
to TE in ``tvm_fuel.op.legalize`` / ``tvm_fuel.op.decompose``.

Shapes (used identically everywhere): q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D]; Hq % Hkv == 0 and
query head h reads KV head h // (Hq / Hkv). Paged caches are [num_blocks, block_size, Hkv, D].
Dtypes: q, k, v, do float32, float16 or bfloat16 (all alike); accumulation is float32.

Contents:
    flash_attn, flash_attn_backward, flash_attn_backward_q, flash_attn_backward_k,
    flash_attn_backward_v, paged_attn, softmax_backward
    flash_attn_jvp, flash_attn_double_backward -- forward mode, and the VJP of the backward
    flash_attn_varlen, flash_attn_varlen_backward -- FlashAttention's packed variable-length batches
"""

from __future__ import annotations

from tvm import relax

from .config import as_bool, as_int, positive_int
from .spec import SPECS, attn_attrs


def flash_attn(q, k, v, alibi_slopes=None, attn_mask=None, *, softmax_scale=None, causal=False,
               window_size=(-1, -1), softcap=0.0, sinks=None, return_lse=False, sink_tokens=0) -> relax.Call:
    """Fused scaled-dot-product attention (FlashAttention-2 semantics).

    Parameters
    ----------
    q : relax.Expr
        shape: [B, Hq, Sq, D], dtype: float32, float16 or bfloat16.
    k, v : relax.Expr
        shape: [B, Hkv, Sk, D], dtype: as q. Hq must be a multiple of Hkv (GQA/MQA).
    alibi_slopes : relax.Expr, optional
        shape: [Hq], dtype: float32. Adds ``-slope_h * |i + Sk - Sq - j|`` to each logit.
    attn_mask : relax.Expr, optional
        bool (True = attend) or float (added to the logits), broadcastable to [B, Hq, Sq, Sk].
    softmax_scale : float, optional
        Logit scale; defaults to ``1 / sqrt(D)``.
    causal : bool
        Bottom-right aligned causal mask (``window_size[1] = 0``).
    window_size : (int, int)
        (left, right) sliding window around the bottom-right diagonal; -1 is unbounded.
    softcap : float
        When > 0, logits become ``softcap * tanh(logit / softcap)`` before bias and masking.
    sink_tokens : int
        StreamingLLM's attention sinks (TVM's KV cache's sink tokens): keys ``j < sink_tokens`` stay
        visible past the window's left bound (its right bound and the length still apply); 0: none.
    sinks : relax.Expr, optional
        shape: [Hq], dtype: float32. Attention sinks (gpt-oss; FlashAttention 3's and vLLM's
        ``s_aux``): each row's softmax gets one more logit, ``sinks[h]`` as it is (not scaled,
        capped or masked), that weighs no value, so ``out = sum_j p_j v_j`` with
        ``p_j = exp(s_j) / (exp(sinks[h]) + sum_j' exp(s_j'))``.
    return_lse : bool
        Also return the natural-log log-sum-exp of each row (the sink's term included).

    Returns
    -------
    out : relax.Call
        shape: [B, Hq, Sq, D], dtype: as q. A row with no visible key is 0. With ``return_lse``
        the tuple ``(out, lse)``, lse shape: [B, Hq, Sq], dtype: float32, ``-inf`` for such rows
        (``sinks[h]`` with sinks).

    Examples
    --------
    >>> from tvm import relax
    >>> from tvm_fuel import op
    >>> q = relax.Var("q", relax.TensorType((1, 8, 17, 64), "float16"))
    >>> kv = relax.TensorType((1, 2, 97, 64), "float16")
    >>> call = op.flash_attn(q, relax.Var("k", kv), relax.Var("v", kv), causal=True, return_lse=True)
    """
    attrs = attn_attrs("flash_attn", softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, sink_tokens=sink_tokens)
    attrs["return_lse"] = as_bool("fuel.flash_attn", "return_lse", return_lse)
    return SPECS["flash_attn"].make_call(
        dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes, attn_mask=attn_mask, sinks=sinks), attrs)


def _backward_op(name: str, doc: str):
    """A backward constructor; the four share one signature and differ only in what they return."""
    spec = SPECS[name]

    def constructor(q, k, v, do, alibi_slopes=None, attn_mask=None, *, out=None, lse=None, softmax_scale=None,
                    causal=False, window_size=(-1, -1), softcap=0.0, sinks=None, sink_tokens=0) -> relax.Call:
        attrs = attn_attrs(name, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                            softcap=softcap, sink_tokens=sink_tokens)
        return spec.make_call(dict(q=q, k=k, v=v, do=do, alibi_slopes=alibi_slopes, attn_mask=attn_mask, out=out,
                                   lse=lse, sinks=sinks), attrs)

    constructor.__name__ = constructor.__qualname__ = name
    constructor.__doc__ = doc
    return constructor


flash_attn_backward = _backward_op(
    "flash_attn_backward", """Gradients ``(dq, dk, dv)`` of ``flash_attn`` for the output gradient ``do``.

    Parameters
    ----------
    q, k, v, alibi_slopes, attn_mask, softmax_scale, causal, window_size, softcap, sinks, sink_tokens :
        As for ``flash_attn``.
    do : relax.Expr
        shape: [B, Hq, Sq, D], dtype: as q. The gradient of the loss w.r.t. ``out``.
    out : relax.Expr, optional
        shape: [B, Hq, Sq, D], dtype: as q. The forward's output; with it ``D = rowsum(do * out)``.
    lse : relax.Expr, optional
        shape: [B, Hq, Sq], dtype: float32. The forward's log-sum-exp (with sinks, the forward's
        with the same sinks); without it the softmax state is recomputed.

    Returns
    -------
    grads : relax.Call
        The tuple ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``. For GQA, dk and dv sum
        over the query heads of each group. Masks and ALiBi get no gradient; the sinks' gradient
        is ``tvm_fuel.op.sinks_grad`` (``flash_attn``'s registered gradient returns it).

    Examples
    --------
    >>> from tvm import relax
    >>> from tvm_fuel import op
    >>> t = relax.TensorType((2, 6, 17, 40), "float32")
    >>> q, do = relax.Var("q", t), relax.Var("do", t)
    >>> k = relax.Var("k", relax.TensorType((2, 2, 17, 40), "float32"))
    >>> grads = op.flash_attn_backward(q, k, k, do, causal=True)
    """)
flash_attn_backward_q = _backward_op(
    "flash_attn_backward_q", """``dq`` alone (shape and dtype of q); arguments as ``flash_attn_backward``.""")
flash_attn_backward_k = _backward_op(
    "flash_attn_backward_k", """``dk`` alone (shape and dtype of k); arguments as ``flash_attn_backward``.""")
flash_attn_backward_v = _backward_op(
    "flash_attn_backward_v", """``dv`` alone (shape and dtype of v); arguments as ``flash_attn_backward``.""")


def paged_attn(q, k_cache, v_cache, block_table, context_lens, alibi_slopes=None, *, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0, sinks=None, sink_tokens=0, k_scale=None,
               v_scale=None) -> relax.Call:
    """Attention of new queries over a paged KV cache (decode: Sq = 1; multi-query: Sq > 1).

    The Sq queries of sequence b are the last Sq tokens of its context of ``context_lens[b]``
    tokens (their K/V already written to the cache), so query i sits at position
    ``context_lens[b] - Sq + i``: causal and window masks are aligned to it.

    Parameters
    ----------
    q : relax.Expr
        shape: [B, Hq, Sq, D], dtype: float32, float16 or bfloat16.
    k_cache, v_cache : relax.Expr
        shape: [num_blocks, block_size, Hkv, D] (NHD pages), dtype: as q, or an 8-bit cache
        (both alike): float8_e4m3fn or float8_e5m2 (vLLM's fp8 caches), int8. An element x stands
        for ``x * scale`` (``tvm_fuel.op.quant``), dequantized as the kernels load it.
    block_table : relax.Expr
        shape: [B, max_blocks], dtype: int32 (uint32, int64 accepted). Token t of sequence b lives
        in block ``block_table[b, t // block_size]`` at offset ``t % block_size``. Entries past the
        sequence's live blocks are never read and may hold anything (-1 padding, say).
    context_lens : relax.Expr
        shape: [B], dtype: int32 (uint32, int64 accepted). 0 <= context_lens[b] <= max_blocks * block_size.
    alibi_slopes, softmax_scale, causal, window_size, softcap, sinks, sink_tokens :
        As for ``flash_attn``.
    k_scale, v_scale : relax.Expr, optional
        The scales of an 8-bit cache, both or neither, dtype: float32. fp8 caches: shape [] (one
        for the cache) or [Hkv] (one per KV head), vLLM's convention; absent means 1. int8 caches
        (required): shape [num_blocks, block_size, Hkv], one per token and KV head (the rule that
        sets them: ``tvm_fuel.kv_cache.PagedKVCache``).

    Returns
    -------
    out : relax.Call
        shape: [B, Hq, Sq, D], dtype: as q. Rows with no visible key (empty context) are 0.

    Examples
    --------
    >>> from tvm import relax
    >>> from tvm_fuel import op
    >>> q = relax.Var("q", relax.TensorType((4, 32, 1, 128), "float16"))
    >>> cache = relax.TensorType((256, 16, 8, 128), "float16")
    >>> table = relax.Var("block_table", relax.TensorType((4, 64), "int32"))
    >>> lens = relax.Var("context_lens", relax.TensorType((4,), "int32"))
    >>> out = op.paged_attn(q, relax.Var("k_cache", cache), relax.Var("v_cache", cache), table, lens)
    """
    attrs = attn_attrs("paged_attn", softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, sink_tokens=sink_tokens)
    return SPECS["paged_attn"].make_call(
        dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, context_lens=context_lens,
             alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale), attrs)


def _varlen_attrs(name: str, max_seqlen_q, max_seqlen_k, **options) -> dict:
    attrs = attn_attrs(name, **options)
    for arg, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        attrs[arg] = 0 if value is None else positive_int(f"fuel.{name}", arg, value)
    return attrs


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, *, max_seqlen_q=None,
                      max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      sinks=None, sink_tokens=0, return_lse=False) -> relax.Call:
    """Attention over a packed batch of variable-length sequences (FlashAttention's
    ``flash_attn_varlen_func``; FlashInfer's ragged prefill): no padding, no mask.

    Sequence b holds query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (Sq_b of them) and key
    rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` (Sk_b); it attends only to itself, with every
    option applied per sequence as ``flash_attn`` applies it to one batch row (causal and windows
    bottom-right aligned: query i sits at position ``i + Sk_b - Sq_b``). Work follows
    ``sum_b Sq_b * Sk_b``.

    Parameters
    ----------
    q : relax.Expr
        shape: [total_q, Hq, D], dtype: float32, float16 or bfloat16.
    k, v : relax.Expr
        shape: [total_k, Hkv, D], dtype: as q. Hq must be a multiple of Hkv (GQA/MQA).
    cu_seqlens_q, cu_seqlens_k : relax.Expr
        shape: [B + 1], dtype: int32 (uint32, int64 accepted). Each starts at 0, never decreases and
        ends at most at ``total_q`` (``total_k``); rows past the last sequence belong to none and
        get 0 (lse -inf). Checked at run time on CPU targets (an error names the argument).
    alibi_slopes, softmax_scale, causal, window_size, softcap, sinks, sink_tokens :
        As for ``flash_attn`` (``alibi_slopes`` and ``sinks`` shape [Hq], float32).
    max_seqlen_q, max_seqlen_k : int, optional
        FlashAttention's bounds on Sq_b and Sk_b. Not needed (the kernels and the floor find the
        longest sequence); when given, a longer sequence is an error (CPU targets).
    return_lse : bool
        Also return the natural-log log-sum-exp of each row.

    Returns
    -------
    out : relax.Call
        shape: [total_q, Hq, D], dtype: as q. A row with no visible key is 0. With ``return_lse``
        the tuple ``(out, lse)``, lse shape: [Hq, total_q] (FlashAttention's varlen layout),
        dtype: float32, ``-inf`` for such rows (``sinks[h]`` with sinks).

    Examples
    --------
    >>> from tvm import relax
    >>> from tvm_fuel import op
    >>> q = relax.Var("q", relax.TensorType((131, 8, 64), "float16"))
    >>> kv = relax.TensorType((150, 2, 64), "float16")
    >>> cu = relax.TensorType((4,), "int32")
    >>> out = op.flash_attn_varlen(q, relax.Var("k", kv), relax.Var("v", kv), relax.Var("cu_q", cu),
    ...                            relax.Var("cu_k", cu), causal=True)
    """
    attrs = _varlen_attrs("flash_attn_varlen", max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                          causal=causal, window_size=window_size, softcap=softcap, sink_tokens=sink_tokens)
    attrs["return_lse"] = as_bool("fuel.flash_attn_varlen", "return_lse", return_lse)
    return SPECS["flash_attn_varlen"].make_call(
        dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes,
             sinks=sinks), attrs)


def flash_attn_varlen_backward(q, k, v, do, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, *, out=None, lse=None,
                               max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, sinks=None, sink_tokens=0) -> relax.Call:
    """Gradients ``(dq, dk, dv)`` of ``flash_attn_varlen`` for the output gradient ``do``.

    Parameters
    ----------
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
    window_size, softcap, sinks, sink_tokens :
        As for ``flash_attn_varlen``.
    do : relax.Expr
        shape: [total_q, Hq, D], dtype: as q. The gradient of the loss w.r.t. ``out``.
    out : relax.Expr, optional
        shape: [total_q, Hq, D], dtype: as q. The forward's output; with it ``D = rowsum(do * out)``.
    lse : relax.Expr, optional
        shape: [Hq, total_q], dtype: float32. The forward's log-sum-exp (with the same sinks);
        without it the softmax state is recomputed.

    Returns
    -------
    grads : relax.Call
        The tuple ``(dq, dk, dv)`` shaped and typed like ``(q, k, v)``. For GQA, dk and dv sum over
        the query heads of each group; rows of no sequence get 0. The sinks' gradient is
        ``tvm_fuel.op.sinks_grad(..., packed=True)`` (``flash_attn_varlen``'s registered gradient returns it).

    Examples
    --------
    >>> from tvm import relax
    >>> from tvm_fuel import op
    >>> t = relax.TensorType((131, 6, 40), "float32")
    >>> q, do = relax.Var("q", t), relax.Var("do", t)
    >>> k = relax.Var("k", relax.TensorType((150, 2, 40), "float32"))
    >>> cu = relax.TensorType((4,), "int32")
    >>> grads = op.flash_attn_varlen_backward(q, k, k, do, relax.Var("cu_q", cu), relax.Var("cu_k", cu))
    """
    attrs = _varlen_attrs("flash_attn_varlen_backward", max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                          causal=causal, window_size=window_size, softcap=softcap, sink_tokens=sink_tokens)
    return SPECS["flash_attn_varlen_backward"].make_call(
        dict(q=q, k=k, v=v, do=do, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes,
             out=out, lse=lse, sinks=sinks), attrs)


def softmax_backward(probs, dprobs, *, axis: int = -1) -> relax.Call:
    """Gradient of softmax w.r.t. its logits: ``probs * (dprobs - sum(probs * dprobs, axis))``.

    Parameters
    ----------
    probs : relax.Expr
        The softmax output, any shape, dtype float32, float16 or bfloat16.
    dprobs : relax.Expr
        The gradient w.r.t. ``probs``; same shape and dtype.
    axis : int
        The softmax axis (default: the last).

    Examples
    --------
    >>> from tvm import relax
    >>> from tvm_fuel import op
    >>> t = relax.TensorType((2, 8, 17, 97), "float32")
    >>> dlogits = op.softmax_backward(relax.Var("p", t), relax.Var("dp", t))
    """
    axis = as_int("fuel.softmax_backward", "axis", axis)  # numpy integers qualify, bools do not
    return SPECS["softmax_backward"].make_call(dict(probs=probs, dprobs=dprobs), {"axis": axis})


def flash_attn_jvp(q, k, v, q_dot=None, k_dot=None, v_dot=None, alibi_slopes=None, attn_mask=None, *,
                   softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                   return_lse=False, sink_tokens=0) -> relax.Call:
    """Forward mode: ``flash_attn``'s output and its directional derivative along a tangent.

    ``out_dot = P_dot V + P v_dot`` with ``P_dot = P * (logit_dot - rowsum(P * logit_dot))`` and
    ``logit_dot = softcap'(capped) * scale * (q_dot K^T + Q k_dot^T)`` (ALiBi and masks are constants).

    Parameters
    ----------
    q, k, v, alibi_slopes, attn_mask, softmax_scale, causal, window_size, softcap, return_lse, sink_tokens :
        As for ``flash_attn``.
    q_dot : relax.Expr, optional
        shape: [B, Hq, Sq, D], dtype: as q. The tangent of q; absent means 0.
    k_dot, v_dot : relax.Expr, optional
        shape: [B, Hkv, Sk, D], dtype: as q. The tangents of k and v; absent means 0.

    Returns
    -------
    result : relax.Call
        The tuple ``(out, out_dot)``, both shape: [B, Hq, Sq, D], dtype: as q; with ``return_lse``
        ``(out, out_dot, lse)``, lse shape: [B, Hq, Sq], dtype: float32. A row with no visible key
        has out = out_dot = 0 and lse = ``-inf``.

    Examples
    --------
    >>> from tvm import relax
    >>> from tvm_fuel import op
    >>> t = relax.TensorType((1, 8, 17, 64), "float32")
    >>> kv = relax.TensorType((1, 2, 97, 64), "float32")
    >>> q, q_dot = relax.Var("q", t), relax.Var("q_dot", t)
    >>> k, v = relax.Var("k", kv), relax.Var("v", kv)
    >>> out_and_tangent = op.flash_attn_jvp(q, k, v, q_dot, causal=True)
    """
    attrs = attn_attrs("flash_attn_jvp", softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, sink_tokens=sink_tokens)
    attrs["return_lse"] = as_bool("fuel.flash_attn_jvp", "return_lse", return_lse)
    return SPECS["flash_attn_jvp"].make_call(
        dict(q=q, k=k, v=v, q_dot=q_dot, k_dot=k_dot, v_dot=v_dot, alibi_slopes=alibi_slopes, attn_mask=attn_mask),
        attrs)


def flash_attn_double_backward(q, k, v, do, dq_bar=None, dk_bar=None, dv_bar=None, alibi_slopes=None,
                               attn_mask=None, *, out=None, lse=None, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, sink_tokens=0) -> relax.Call:
    """The vector-Jacobian product of ``(dq, dk, dv) = flash_attn_backward(q, k, v, do)`` with the
    cotangents ``(dq_bar, dk_bar, dv_bar)``: the gradients a second-order loss sends to q, k, v, do.

    Since the backward is the gradient of ``sum(out * do)``, this is its directional derivative
    along ``(dq_bar, dk_bar, dv_bar)`` with ``do`` held, and ``do_grad = out_dot`` along the same
    direction (``flash_attn_jvp``).

    Parameters
    ----------
    q, k, v, do, alibi_slopes, attn_mask, out, lse, softmax_scale, causal, window_size, softcap, sink_tokens :
        As for ``flash_attn_backward``.
    dq_bar : relax.Expr, optional
        shape: [B, Hq, Sq, D], dtype: as q. The cotangent of dq; absent means 0.
    dk_bar, dv_bar : relax.Expr, optional
        shape: [B, Hkv, Sk, D], dtype: as q. The cotangents of dk and dv; absent means 0.

    Returns
    -------
    grads : relax.Call
        The tuple ``(q_grad, k_grad, v_grad, do_grad)`` shaped and typed like ``(q, k, v, do)``.
        For GQA, k_grad and v_grad sum over the query heads of each group. Masks and ALiBi get no
        gradient; rows with no visible key contribute 0.

    Examples
    --------
    >>> from tvm import relax
    >>> from tvm_fuel import op
    >>> t = relax.TensorType((2, 6, 17, 40), "float32")
    >>> kv = relax.TensorType((2, 2, 33, 40), "float32")
    >>> q, do, dq_bar = relax.Var("q", t), relax.Var("do", t), relax.Var("dq_bar", t)
    >>> k, v = relax.Var("k", kv), relax.Var("v", kv)
    >>> grads = op.flash_attn_double_backward(q, k, v, do, dq_bar, causal=True)
    """
    attrs = attn_attrs("flash_attn_double_backward", softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, sink_tokens=sink_tokens)
    return SPECS["flash_attn_double_backward"].make_call(
        dict(q=q, k=k, v=v, do=do, dq_bar=dq_bar, dk_bar=dk_bar, dv_bar=dv_bar, alibi_slopes=alibi_slopes,
             attn_mask=attn_mask, out=out, lse=lse), attrs)
