"""Normalisation and its dispatch: RMSNorm, Gemma's (1 + w) RMSNorm, LayerNorm.

Letters (the package legend): M rows (every leading axis flattened), D normalised features (the weight's
trailing axes flattened), I row blocks (programs) of the backward kernel.

    rmsnorm         y = x * rsqrt(mean(x^2) + eps) * w
    gemma_rmsnorm   y = x * rsqrt(mean(x^2) + eps) * (1 + w)
    layernorm       y = (x - mean(x)) * rsqrt(var(x) + eps) * w [+ b]

Statistics are fp32 whatever the input dtype; the output has the input's dtype.
`add_norm(x, residual, ...)` fuses the residual add: it returns `(h, norm(h))` with
`h = residual + x`, the new residual stream.

| impl      | what                                                                  |
|-----------|-----------------------------------------------------------------------|
| reference | plain jnp, left to XLA's fusion                                       |
| pallas    | one fused kernel forward, one backward (dx, dw, db), under one custom_vjp; Triton on GPU (`norm_gpu.py`), Mosaic on TPU (`norm_tpu.py`) |

`default` is `pallas` on GPU and TPU and `reference` elsewhere (the platform compiled for,
`backend.platform()`). Explicit `pallas` on a
CPU raises `UnsupportedFeatureError` unless interpret mode is on (`kernels/backend.py`),
which then runs the kernel of the interpreted platform (GPU unless told `tpu`).
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from modern_jax.config import NORM_TYPES
from modern_jax.execution import NORM_IMPLS
from modern_jax.kernels import norm_gpu, norm_tpu
from modern_jax.kernels.backend import (
    UnsupportedFeatureError,
    interpret_target,
    note_kernel,
    pallas_platform,
    platform,
    varying_axes,
    vary_over,
)

# DEFAULT, REFERENCE, PALLAS: the names `execution.NORM_IMPLS` defines
NormImpl = enum.StrEnum("NormImpl", {name.upper(): name for name in NORM_IMPLS})


def resolve(impl: NormImpl | str) -> NormImpl:
    impl = NormImpl(impl)
    if impl is NormImpl.DEFAULT:
        return NormImpl.PALLAS if platform() in ("gpu", "tpu") else NormImpl.REFERENCE
    if impl is NormImpl.PALLAS and pallas_platform() is None:
        raise UnsupportedFeatureError(
            f"execution.norm_impl='pallas' cannot run here: it needs a GPU or a TPU (this computation is compiled for "
            f"{platform()!r}; "
            "on CPU set MODERN_JAX_PALLAS_INTERPRET=1 or use kernels.pallas_interpret())")
    return impl


def norm(x, weight, bias=None, *, kind: str = "rmsnorm", eps: float = 1e-6, impl: NormImpl | str = "reference"):
    """Normalise `x` over its trailing `weight.ndim` axes."""
    return _dispatch(x, None, weight, bias, kind, eps, impl)[1]


def add_norm(x, residual, weight, bias=None, *, kind: str = "rmsnorm", eps: float = 1e-6,
             impl: NormImpl | str = "reference"):
    """`(h, norm(h))` with `h = residual + x`: the residual add fused into the norm."""
    return _dispatch(x, residual, weight, bias, kind, eps, impl)


def norm_reference(x, weight, bias=None, *, kind: str = "rmsnorm", eps: float = 1e-6):
    axes = tuple(range(x.ndim - weight.ndim, x.ndim))
    x32 = x.astype(jnp.float32)
    if kind == "layernorm":
        x32 = x32 - jnp.mean(x32, axis=axes, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axes, keepdims=True) + eps)
    lead = (1,) * (x.ndim - weight.ndim)  # the weight and bias broadcast over every leading axis
    w32 = weight.astype(jnp.float32).reshape(lead + weight.shape)
    y = y * (1.0 + w32 if kind == "gemma_rmsnorm" else w32)
    if bias is not None:
        y = y + bias.astype(jnp.float32).reshape(lead + bias.shape)
    return y.astype(x.dtype)


def _dispatch(x, residual, weight, bias, kind, eps, impl):
    if kind not in NORM_TYPES:  # the kinds are named once, by the config (`norm_type`)
        raise ValueError(f"norm kind {kind!r} is not one of {', '.join(NORM_TYPES)}")
    impl = resolve(impl)
    note_kernel("norm", impl.value)
    if impl is NormImpl.REFERENCE:
        h = x if residual is None else residual + x
        return h, norm_reference(h, weight, bias, kind=kind, eps=eps)
    lead, D = x.shape[: x.ndim - weight.ndim], math.prod(weight.shape)
    if residual is not None:  # one dtype for the stream, so the kernels' cotangents match their inputs
        dtype = jnp.result_type(x, residual)
        x, residual = x.astype(dtype), residual.astype(dtype)
    flat = lambda a: None if a is None else a.reshape(-1, D)  # noqa: E731
    call = _Call(kind, float(eps), pallas_platform(), interpret_target() is not None)
    args = (flat(x), flat(residual), weight.reshape(D), None if bias is None else bias.reshape(D))
    h_MD, y_MD = _fused(call, *vary_over(args, varying_axes(args)))
    return h_MD.reshape(*lead, *weight.shape), y_MD.reshape(*lead, *weight.shape)


# ----- one custom_vjp around the two kernels ---------------------------------------------


@dataclass(frozen=True)
class _Call:
    kind: str
    eps: float
    platform: str  # whose kernels: "gpu" (Triton) or "tpu" (Mosaic)
    interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(call, x_MD, res_MD, w_D, b_D):
    return _forward(call, x_MD, res_MD, w_D, b_D)


def _fused_fwd(call, x_MD, res_MD, w_D, b_D):
    h_MD, y_MD = _forward(call, x_MD, res_MD, w_D, b_D)
    return (h_MD, y_MD), (h_MD, w_D, b_D, res_MD is not None)


def _fused_bwd(call, saved, cotangents):
    h_MD, w_D, b_D, fused_add = saved
    dh_MD, dy_MD = cotangents
    dx_MD, dw_D, db_D = _backward(call, h_MD, dy_MD, dh_MD if fused_add else None, w_D, b_D is not None)
    return dx_MD, dx_MD if fused_add else None, dw_D.astype(w_D.dtype), None if b_D is None else db_D.astype(b_D.dtype)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _forward(call, x_MD, res_MD, w_D, b_D):
    kernels = norm_gpu if call.platform == "gpu" else norm_tpu
    return kernels.forward(call, x_MD, res_MD, w_D, b_D)


def _backward(call, h_MD, dy_MD, dh_MD, w_D, has_bias):
    kernels = norm_gpu if call.platform == "gpu" else norm_tpu
    return kernels.backward(call, h_MD, dy_MD, dh_MD, w_D, has_bias)
