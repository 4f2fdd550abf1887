"""Relax constructors of the norms' backward ops (``tvm_fuel.op``): over the rows of a [N, C] view.

Contents:
    layer_norm_backward, rms_norm_backward
"""

from __future__ import annotations

from tvm import relax

from .spec import SPECS


def layer_norm_backward(dy, x, gamma, mean, rstd) -> relax.Call:
    """Layer norm's backward over each row of a [N, C] view (PyTorch's
    ``native_layer_norm_backward``), from the forward's saved statistics.

    With ``x_hat = (x - mean) * rstd`` and ``g = dy * gamma`` per row:
    ``dx = rstd * (g - mean_C(g) - x_hat * mean_C(g * x_hat))``, ``dgamma = sum_N(dy * x_hat)``,
    ``dbeta = sum_N(dy)``. The registered gradient of ``relax.nn.layer_norm`` calls it over the
    trailing normalized axes flattened; its own gradient is the composition's (second order).

    Parameters
    ----------
    dy : relax.Expr
        shape: [N, C], dtype: float32, float16, bfloat16 or float64. The output's gradient.
    x : relax.Expr
        shape: [N, C], dtype: as dy. The forward's input.
    gamma : relax.Expr
        shape: [C], dtype: as dy. The scale.
    mean, rstd : relax.Expr
        shape: [N], dtype: float32 (float64 for float64 x). The row mean and 1 / sqrt(var + eps).

    Returns
    -------
    grads : relax.Call
        The tuple ``(dx, dgamma, dbeta)``: [N, C], [C], [C], dtype as dy; accumulated in the
        statistics' dtype.

    Examples
    --------
    >>> from tvm import relax
    >>> from tvm_fuel import op
    >>> t, row = relax.TensorType((97, 40), "float32"), relax.TensorType((97,), "float32")
    >>> grads = op.layer_norm_backward(relax.Var("dy", t), relax.Var("x", t),
    ...                                relax.Var("gamma", relax.TensorType((40,), "float32")),
    ...                                relax.Var("mean", row), relax.Var("rstd", row))
    """
    return SPECS["layer_norm_backward"].make_call(dict(dy=dy, x=x, gamma=gamma, mean=mean, rstd=rstd), {})


def rms_norm_backward(dy, x, weight, rstd) -> relax.Call:
    """RMS norm's backward over each row of a [N, C] view, from the forward's saved ``rstd``.

    With ``x_hat = x * rstd`` and ``g = dy * weight`` per row: ``dx = rstd * (g - x_hat *
    mean_C(g * x_hat))``, ``dweight = sum_N(dy * x_hat)``.

    Parameters
    ----------
    dy, x : relax.Expr
        shape: [N, C], dtype: float32, float16, bfloat16 or float64.
    weight : relax.Expr
        shape: [C], dtype: as dy.
    rstd : relax.Expr
        shape: [N], dtype: float32 (float64 for float64 x). 1 / sqrt(mean_C(x^2) + eps).

    Returns
    -------
    grads : relax.Call
        The tuple ``(dx, dweight)``: [N, C], [C], dtype as dy.
    """
    return SPECS["rms_norm_backward"].make_call(dict(dy=dy, x=x, weight=weight, rstd=rstd), {})
