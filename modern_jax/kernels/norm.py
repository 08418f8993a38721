"""Normalisation and its dispatch: RMSNorm, Gemma's (1 + w) RMSNorm, LayerNorm.

Letters: M rows (every leading axis flattened), D normalised features (the weight's
trailing axes flattened), P programs of the backward kernel.

    rmsnorm         y = x * rsqrt(mean(x^2) + eps) * w
    gemma_rmsnorm   y = x * rsqrt(mean(x^2) + eps) * (1 + w)
    layernorm       y = (x - mean(x)) * rsqrt(var(x) + eps) * w [+ b]

Statistics are fp32 whatever the input dtype; the output has the input's dtype.
`add_norm(x, residual, ...)` fuses the residual add: it returns `(h, norm(h))` with
`h = residual + x`, the new residual stream.

| impl      | what                                                                  |
|-----------|-----------------------------------------------------------------------|
| reference | plain jnp, left to XLA's fusion                                       |
| pallas    | one fused kernel forward, one backward (dx, dw, db), under one custom_vjp; Triton on GPU, Mosaic on TPU |

`default` is `pallas` on GPU and TPU and `reference` elsewhere. Explicit `pallas` on a
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from modern_jax.kernels.backend import (
    UnsupportedFeatureError,
    interpret_target,
    out_struct,
    pallas_platform,
    platform,
    varying_axes,
    vary_over,
)

KINDS = ("rmsnorm", "gemma_rmsnorm", "layernorm")


class NormImpl(enum.StrEnum):
    DEFAULT = "default"
    REFERENCE = "reference"
    PALLAS = "pallas"


def resolve(impl: NormImpl | str) -> NormImpl:
    impl = NormImpl(impl)
    if impl is NormImpl.DEFAULT:
        return NormImpl.PALLAS if platform() in ("gpu", "tpu") else NormImpl.REFERENCE
    if impl is NormImpl.PALLAS and pallas_platform() is None:
        raise UnsupportedFeatureError(
            f"norm_impl='pallas' cannot run here: it needs a GPU or a TPU (this backend is {platform()!r}; "
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
    w32 = weight.astype(jnp.float32)
    y = y * (1.0 + w32 if kind == "gemma_rmsnorm" else w32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def _dispatch(x, residual, weight, bias, kind, eps, impl):
    if kind not in KINDS:
        raise ValueError(f"norm kind {kind!r} is not one of {', '.join(KINDS)}")
    impl = resolve(impl)
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
    kernels = _GPU if call.platform == "gpu" else _TPU
    return kernels.forward(call, x_MD, res_MD, w_D, b_D)


def _backward(call, h_MD, dy_MD, dh_MD, w_D, has_bias):
    kernels = _GPU if call.platform == "gpu" else _TPU
    return kernels.backward(call, h_MD, dy_MD, dh_MD, w_D, has_bias)


# ----- row math shared by both kernels (rows on the leading axis, fp32) ---------------------


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


def _rows_forward(h, w, b, kind, eps, D, valid=None):
    xhat, _ = _normalise(h, kind, eps, D, valid)
    y = xhat * _scale(w, kind)
    return y if b is None else y + b


def _rows_backward(h, w, dy, kind, eps, D, valid=None):
    """`(dx, dy * xhat)` for rows `h` with output cotangent `dy`."""
    xhat, rstd = _normalise(h, kind, eps, D, valid)
    g = dy * _scale(w, kind)
    dx = g - xhat * (jnp.sum(g * xhat, axis=-1, keepdims=True) / D)
    if kind == "layernorm":
        dx = dx - jnp.sum(g, axis=-1, keepdims=True) / D
    return dx * rstd, dy * xhat


# ----- GPU: Triton, one row at a time as one vector ----------------------------------------


class _GPU:
    """Forward: one program per row. Backward: P programs, each a run of rows, each writing
    its partial dw / db `[P, D]`, summed afterwards (deterministic, no atomics)."""

    @staticmethod
    def _params(Dp):
        return plgpu.CompilerParams(num_warps=min(max(Dp // 256, 1), 16), num_stages=1)

    @staticmethod
    def forward(call, x_MD, res_MD, w_D, b_D):
        M, D = x_MD.shape
        Dp = pl.next_power_of_2(D)
        fused_add, has_bias = res_MD is not None, b_D is not None

        def kernel(*refs):
            refs = list(refs)
            x_ref = refs.pop(0)
            res_ref = refs.pop(0) if fused_add else None
            w_ref = refs.pop(0)
            b_ref = refs.pop(0) if has_bias else None
            h_ref, y_ref = refs if fused_add else (None, refs[0])
            cols = jnp.arange(Dp)
            valid = cols < D
            load = lambda ref: plgpu.load(ref.at[cols], mask=valid, other=0.0)  # noqa: E731
            h = load(x_ref)
            if fused_add:
                h = (load(res_ref) + h).astype(h_ref.dtype)
                plgpu.store(h_ref.at[cols], h, mask=valid)
            b = load(b_ref).astype(jnp.float32) if has_bias else None
            y = _rows_forward(h.astype(jnp.float32), load(w_ref).astype(jnp.float32), b, call.kind, call.eps, D, valid)
            plgpu.store(y_ref.at[cols], y.astype(y_ref.dtype), mask=valid)

        row = pl.BlockSpec((None, D), lambda i: (i, 0))
        vec = pl.BlockSpec((D,), lambda i: (0,))
        args = [x_MD] + ([res_MD] if fused_add else []) + [w_D] + ([b_D] if has_bias else [])
        in_specs = [row] + ([row] if fused_add else []) + [vec] + ([vec] if has_bias else [])
        out_shape = [out_struct((M, D), x_MD.dtype, x_MD)] * (2 if fused_add else 1)
        outs = pl.pallas_call(
            kernel, grid=(M,), in_specs=in_specs, out_specs=[row] * len(out_shape), out_shape=out_shape,
            compiler_params=_GPU._params(Dp), interpret=call.interpret, name="norm_gpu_fwd",
        )(*args)
        return (outs[0], outs[1]) if fused_add else (x_MD, outs[0])

    @staticmethod
    def backward(call, h_MD, dy_MD, dh_MD, w_D, has_bias):
        M, D = h_MD.shape
        Dp = pl.next_power_of_2(D)
        rows_per_program = max(1, -(-M // 1024))
        P = -(-M // rows_per_program)
        fused_add = dh_MD is not None

        def kernel(*refs):
            refs = list(refs)
            h_ref, dy_ref = refs.pop(0), refs.pop(0)
            dh_ref = refs.pop(0) if fused_add else None
            w_ref, dx_ref, dw_ref, db_ref = refs
            cols = jnp.arange(Dp)
            valid = cols < D
            w = plgpu.load(w_ref.at[cols], mask=valid, other=0.0).astype(jnp.float32)
            first = pl.program_id(0) * rows_per_program

            def body(r, acc):
                row = first + r
                load = lambda ref: plgpu.load(ref.at[row, cols], mask=valid, other=0.0).astype(jnp.float32)  # noqa: E731
                dy = load(dy_ref)
                dx, dw = _rows_backward(load(h_ref), w, dy, call.kind, call.eps, D, valid)
                if fused_add:
                    dx = dx + load(dh_ref)
                plgpu.store(dx_ref.at[row, cols], dx.astype(dx_ref.dtype), mask=valid)
                return acc[0] + dw, acc[1] + dy

            n_rows = jnp.minimum(rows_per_program, M - first)
            zeros = jnp.zeros((Dp,), jnp.float32)
            dw, db = jax.lax.fori_loop(0, n_rows, body, (zeros, zeros))
            plgpu.store(dw_ref.at[cols], dw, mask=valid)
            plgpu.store(db_ref.at[cols], db, mask=valid)

        full = pl.BlockSpec((M, D), lambda p: (0, 0))
        partial = pl.BlockSpec((None, D), lambda p: (p, 0))
        args = [h_MD, dy_MD] + ([dh_MD] if fused_add else []) + [w_D]
        in_specs = [full, full] + ([full] if fused_add else []) + [pl.BlockSpec((D,), lambda p: (0,))]
        dx_MD, dw_PD, db_PD = pl.pallas_call(
            kernel, grid=(P,), in_specs=in_specs, out_specs=[full, partial, partial],
            out_shape=[out_struct((M, D), h_MD.dtype, h_MD), out_struct((P, D), jnp.float32, h_MD),
                       out_struct((P, D), jnp.float32, h_MD)],
            compiler_params=_GPU._params(Dp), interpret=call.interpret, name="norm_gpu_bwd",
        )(*args)
        return dx_MD, dw_PD.sum(0), db_PD.sum(0) if has_bias else None


# ----- TPU: Mosaic, a block of rows at a time -----------------------------------------------


class _TPU:
    """Blocks of `rows` rows by the whole feature axis; the backward writes one partial
    dw / db per block (`[P, 1, D]`), summed afterwards. A ragged last block is masked."""

    @staticmethod
    def _rows(M, D):
        rows = max(8, min(1024, (1 << 18) // max(D, 1)) // 8 * 8)  # about 1 MiB of fp32 per block
        return min(rows, -(-M // 8) * 8)

    @staticmethod
    def forward(call, x_MD, res_MD, w_D, b_D):
        M, D = x_MD.shape
        rows = _TPU._rows(M, D)
        fused_add, has_bias = res_MD is not None, b_D is not None

        def kernel(*refs):
            refs = list(refs)
            x_ref = refs.pop(0)
            res_ref = refs.pop(0) if fused_add else None
            w_ref = refs.pop(0)
            b_ref = refs.pop(0) if has_bias else None
            h_ref, y_ref = refs if fused_add else (None, refs[0])
            h = x_ref[...]
            if fused_add:
                h = (res_ref[...] + h).astype(h_ref.dtype)
                h_ref[...] = h
            b = b_ref[...].astype(jnp.float32) if has_bias else None
            y = _rows_forward(h.astype(jnp.float32), w_ref[...].astype(jnp.float32), b, call.kind, call.eps, D)
            y_ref[...] = y.astype(y_ref.dtype)

        block = pl.BlockSpec((rows, D), lambda i: (i, 0))
        vec = pl.BlockSpec((1, D), lambda i: (0, 0))
        args = [x_MD] + ([res_MD] if fused_add else []) + [w_D[None]] + ([b_D[None]] if has_bias else [])
        in_specs = [block] + ([block] if fused_add else []) + [vec] + ([vec] if has_bias else [])
        out_shape = [out_struct((M, D), x_MD.dtype, x_MD)] * (2 if fused_add else 1)
        outs = pl.pallas_call(
            kernel, grid=(pl.cdiv(M, rows),), in_specs=in_specs, out_specs=[block] * len(out_shape),
            out_shape=out_shape, compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
            interpret=call.interpret, name="norm_tpu_fwd",
        )(*args)
        return (outs[0], outs[1]) if fused_add else (x_MD, outs[0])

    @staticmethod
    def backward(call, h_MD, dy_MD, dh_MD, w_D, has_bias):
        M, D = h_MD.shape
        rows = _TPU._rows(M, D)
        P = pl.cdiv(M, rows)
        fused_add = dh_MD is not None

        def kernel(*refs):
            refs = list(refs)
            h_ref, dy_ref = refs.pop(0), refs.pop(0)
            dh_ref = refs.pop(0) if fused_add else None
            w_ref, dx_ref, dw_ref, db_ref = refs
            valid = pl.program_id(0) * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < M
            dy = jnp.where(valid, dy_ref[...].astype(jnp.float32), 0.0)
            h = jnp.where(valid, h_ref[...].astype(jnp.float32), 0.0)
            dx, dw = _rows_backward(h, w_ref[...].astype(jnp.float32), dy, call.kind, call.eps, D)
            if fused_add:
                dx = dx + dh_ref[...].astype(jnp.float32)
            dx_ref[...] = dx.astype(dx_ref.dtype)
            dw_ref[...] = jnp.sum(dw, axis=0, keepdims=True)
            db_ref[...] = jnp.sum(dy, axis=0, keepdims=True)

        block = pl.BlockSpec((rows, D), lambda i: (i, 0))
        partial = pl.BlockSpec((None, 1, D), lambda i: (i, 0, 0))
        args = [h_MD, dy_MD] + ([dh_MD] if fused_add else []) + [w_D[None]]
        in_specs = [block, block] + ([block] if fused_add else []) + [pl.BlockSpec((1, D), lambda i: (0, 0))]
        dx_MD, dw_P1D, db_P1D = pl.pallas_call(
            kernel, grid=(P,), in_specs=in_specs, out_specs=[block, partial, partial],
            out_shape=[out_struct((M, D), h_MD.dtype, h_MD), out_struct((P, 1, D), jnp.float32, h_MD),
                       out_struct((P, 1, D), jnp.float32, h_MD)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
            interpret=call.interpret, name="norm_tpu_bwd",
        )(*args)
        return dx_MD, dw_P1D.sum((0, 1)), db_P1D.sum((0, 1)) if has_bias else None
