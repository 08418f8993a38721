"""Row math shared by the GPU and TPU norm kernels: rows on the leading axis, fp32.

Letters as in `kernels/norm.py`: D normalised features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _normalise(h, kind, eps, D, valid):
    """`(xhat, rstd)` over the last axis; `valid` masks padded columns (Triton) or is None."""
    if kind == "layernorm":
        h = h - jnp.sum(h, axis=-1, keepdims=True) / D
        if valid is not None:
            h = jnp.where(valid, h, 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(h * h, axis=-1, keepdims=True) / D + eps)
    return h * rstd, rstd


def _scale(w, kind):
    return 1.0 + w if kind == "gemma_rmsnorm" else w


def rows_forward(h, w, b, kind, eps, D, valid=None):
    xhat, _ = _normalise(h, kind, eps, D, valid)
    y = xhat * _scale(w, kind)
    return y if b is None else y + b


def rows_backward(h, w, dy, kind, eps, D, valid=None):
    """`(dx, dy * xhat)` for rows `h` with output cotangent `dy`."""
    xhat, rstd = _normalise(h, kind, eps, D, valid)
    g = dy * _scale(w, kind)
    dx = g - xhat * (jnp.sum(g * xhat, axis=-1, keepdims=True) / D)
    if kind == "layernorm":
        dx = dx - jnp.sum(g, axis=-1, keepdims=True) / D
    return dx * rstd, dy * xhat
