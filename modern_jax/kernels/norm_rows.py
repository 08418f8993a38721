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


def forward_refs(refs, fused_add: bool, has_bias: bool):
    """A forward kernel's refs in pallas_call order, as `(x, residual, w, b, h, y)` (absent ones None)."""
    refs = list(refs)
    x, res = refs.pop(0), refs.pop(0) if fused_add else None
    w, b = refs.pop(0), refs.pop(0) if has_bias else None
    h, y = refs if fused_add else (None, refs[0])
    return x, res, w, b, h, y


def backward_refs(refs, fused_add: bool):
    """A backward kernel's refs in pallas_call order, as `(h, dy, dh, w, dx, dw, db)` (dh None unless fused)."""
    refs = list(refs)
    h, dy, dh = refs.pop(0), refs.pop(0), refs.pop(0) if fused_add else None
    return (h, dy, dh, *refs)
