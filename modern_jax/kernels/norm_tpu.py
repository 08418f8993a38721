"""The fused norm on TPU: Mosaic kernels written with Pallas.

Letters (the package legend, as in `kernels/norm.py`): M rows, D features, I row blocks of the
backward kernel.

Blocks of `rows` rows by the whole feature axis; the backward writes one partial
dw / db per block (`[I, 1, D]`), summed afterwards. A ragged last block is masked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from modern_jax.kernels import costs
from modern_jax.kernels.backend import out_struct
from modern_jax.kernels.norm_rows import backward_refs, forward_refs, rows_backward, rows_forward


def _rows(M, D):
    rows = max(8, min(1024, (1 << 18) // max(D, 1)) // 8 * 8)  # about 1 MiB of fp32 per block
    return min(rows, -(-M // 8) * 8)


def forward(call, x_MD, res_MD, w_D, b_D):
    M, D = x_MD.shape
    rows = _rows(M, D)
    fused_add, has_bias = res_MD is not None, b_D is not None

    def kernel(*refs):
        x_ref, res_ref, w_ref, b_ref, h_ref, y_ref = forward_refs(refs, fused_add, has_bias)
        h = x_ref[...]
        if fused_add:
            h = (res_ref[...] + h).astype(h_ref.dtype)
            h_ref[...] = h
        b = b_ref[...].astype(jnp.float32) if has_bias else None
        y = rows_forward(h.astype(jnp.float32), w_ref[...].astype(jnp.float32), b, call.kind, call.eps, D)
        y_ref[...] = y.astype(y_ref.dtype)

    block = pl.BlockSpec((rows, D), lambda i: (i, 0))
    vec = pl.BlockSpec((1, D), lambda i: (0, 0))
    args = [x_MD] + ([res_MD] if fused_add else []) + [w_D[None]] + ([b_D[None]] if has_bias else [])
    in_specs = [block] + ([block] if fused_add else []) + [vec] + ([vec] if has_bias else [])
    out_shape = [out_struct((M, D), x_MD.dtype, x_MD)] * (2 if fused_add else 1)
    outs = pl.pallas_call(
        kernel, grid=(pl.cdiv(M, rows),), in_specs=in_specs, out_specs=[block] * len(out_shape),
        out_shape=out_shape, compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=costs.norm_forward(call.kind, M, D, fused_add=fused_add, bias=has_bias, io=(args, out_shape)),
        interpret=call.interpret, name="norm_tpu_fwd",
    )(*args)
    return (outs[0], outs[1]) if fused_add else (x_MD, outs[0])


def backward(call, h_MD, dy_MD, dh_MD, w_D, has_bias):
    M, D = h_MD.shape
    rows = _rows(M, D)
    blocks = pl.cdiv(M, rows)
    fused_add = dh_MD is not None

    def kernel(*refs):
        h_ref, dy_ref, dh_ref, w_ref, dx_ref, dw_ref, db_ref = backward_refs(refs, fused_add)
        valid = pl.program_id(0) * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < M
        dy = jnp.where(valid, dy_ref[...].astype(jnp.float32), 0.0)
        h = jnp.where(valid, h_ref[...].astype(jnp.float32), 0.0)
        dx, dw = rows_backward(h, w_ref[...].astype(jnp.float32), dy, call.kind, call.eps, D)
        if fused_add:
            dx = dx + dh_ref[...].astype(jnp.float32)
        dx_ref[...] = dx.astype(dx_ref.dtype)
        dw_ref[...] = jnp.sum(dw, axis=0, keepdims=True)
        db_ref[...] = jnp.sum(dy, axis=0, keepdims=True)

    block = pl.BlockSpec((rows, D), lambda i: (i, 0))
    partial = pl.BlockSpec((None, 1, D), lambda i: (i, 0, 0))
    args = [h_MD, dy_MD] + ([dh_MD] if fused_add else []) + [w_D[None]]
    in_specs = [block, block] + ([block] if fused_add else []) + [pl.BlockSpec((1, D), lambda i: (0, 0))]
    out_shape = [out_struct((M, D), h_MD.dtype, h_MD), *[out_struct((blocks, 1, D), jnp.float32, h_MD)] * 2]
    dx_MD, dw_I1D, db_I1D = pl.pallas_call(
        kernel, grid=(blocks,), in_specs=in_specs, out_specs=[block, partial, partial], out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=costs.norm_backward(call.kind, M, D, fused_add=fused_add, io=(args, out_shape)),
        interpret=call.interpret, name="norm_tpu_bwd",
    )(*args)
    return dx_MD, dw_I1D.sum((0, 1)), db_I1D.sum((0, 1)) if has_bias else None
