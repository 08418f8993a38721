"""The fused norm on GPU: Triton kernels written with Pallas.

Letters (the package legend, as in `kernels/norm.py`): M rows, D features, I row blocks (programs)
of the backward kernel.

Forward: one program per row. Backward: I programs, each a run of rows, each writing
its partial dw / db `[I, D]`, summed afterwards (deterministic, no atomics).

A program holds its row, and the backward its dw / db sums, in registers, with up to 16
warps. Compiled for sm_90a and sm_80 (`scripts/check_kernels_compile.py`), rows padded to
8192 features take at most 85 of the 128 registers a thread may have at 16 warps; at 16384
they reach the ceiling: rmsnorm and bfloat16 layernorm still fit, a float32 layernorm
backward spills a few dozen bytes. Wider rows spill more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from modern_jax.kernels import costs
from modern_jax.kernels.backend import out_struct
from modern_jax.kernels.norm_rows import backward_refs, forward_refs, rows_backward, rows_forward


def _params(Dp):
    return plgpu.CompilerParams(num_warps=min(max(Dp // 256, 1), 16), num_stages=1)


def forward(call, x_MD, res_MD, w_D, b_D):
    M, D = x_MD.shape
    Dp = pl.next_power_of_2(D)
    fused_add, has_bias = res_MD is not None, b_D is not None

    def kernel(*refs):
        x_ref, res_ref, w_ref, b_ref, h_ref, y_ref = forward_refs(refs, fused_add, has_bias)
        cols = jnp.arange(Dp)
        valid = cols < D
        load = lambda ref: plgpu.load(ref.at[cols], mask=valid, other=0.0)  # noqa: E731
        h = load(x_ref)
        if fused_add:
            h = (load(res_ref) + h).astype(h_ref.dtype)
            plgpu.store(h_ref.at[cols], h, mask=valid)
        b = load(b_ref).astype(jnp.float32) if has_bias else None
        y = rows_forward(h.astype(jnp.float32), load(w_ref).astype(jnp.float32), b, call.kind, call.eps, D, valid)
        plgpu.store(y_ref.at[cols], y.astype(y_ref.dtype), mask=valid)

    row = pl.BlockSpec((None, D), lambda i: (i, 0))
    vec = pl.BlockSpec((D,), lambda i: (0,))
    args = [x_MD] + ([res_MD] if fused_add else []) + [w_D] + ([b_D] if has_bias else [])
    in_specs = [row] + ([row] if fused_add else []) + [vec] + ([vec] if has_bias else [])
    out_shape = [out_struct((M, D), x_MD.dtype, x_MD)] * (2 if fused_add else 1)
    outs = pl.pallas_call(
        kernel, grid=(M,), in_specs=in_specs, out_specs=[row] * len(out_shape), out_shape=out_shape,
        compiler_params=_params(Dp),
        cost_estimate=costs.norm_forward(call.kind, M, D, fused_add=fused_add, bias=has_bias, io=(args, out_shape)),
        interpret=call.interpret, name="norm_gpu_fwd",
    )(*args)
    return (outs[0], outs[1]) if fused_add else (x_MD, outs[0])


def backward(call, h_MD, dy_MD, dh_MD, w_D, has_bias):
    M, D = h_MD.shape
    Dp = pl.next_power_of_2(D)
    rows_per_program = max(1, -(-M // 1024))
    blocks = -(-M // rows_per_program)
    fused_add = dh_MD is not None

    def kernel(*refs):
        h_ref, dy_ref, dh_ref, w_ref, dx_ref, dw_ref, db_ref = backward_refs(refs, fused_add)
        cols = jnp.arange(Dp)
        valid = cols < D
        w = plgpu.load(w_ref.at[cols], mask=valid, other=0.0).astype(jnp.float32)
        first = pl.program_id(0) * rows_per_program

        def body(r, acc):
            row = first + r
            load = lambda ref: plgpu.load(ref.at[row, cols], mask=valid, other=0.0).astype(jnp.float32)  # noqa: E731
            dy = load(dy_ref)
            dx, dw = rows_backward(load(h_ref), w, dy, call.kind, call.eps, D, valid)
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
    out_shape = [out_struct((M, D), h_MD.dtype, h_MD), *[out_struct((blocks, D), jnp.float32, h_MD)] * 2]
    dx_MD, dw_ID, db_ID = pl.pallas_call(
        kernel, grid=(blocks,), in_specs=in_specs, out_specs=[full, partial, partial], out_shape=out_shape,
        compiler_params=_params(Dp),
        cost_estimate=costs.norm_backward(call.kind, M, D, fused_add=fused_add, io=(args, out_shape)),
        interpret=call.interpret, name="norm_gpu_bwd",
    )(*args)
    return dx_MD, dw_ID.sum(0), db_ID.sum(0) if has_bias else None
