"""Grouped matmul: rows sorted by group, each group multiplied by its own weight.

Letters (the package legend): Z rows (token-expert assignments, sorted by expert), W and O
the contracted and output widths, E groups (experts).

    y[z] = x[z] @ w[e(z)]      rows 0 .. n_0 - 1 use w[0], the next n_1 rows w[1], ...

`impl`:
- `ragged_dot`: `jax.lax.ragged_dot`, which XLA lowers to grouped GEMMs on GPU and TPU;
  on CPU it masks, so it costs E times the dense work there.
- `megablox`: the Pallas TPU grouped matmul (`jax.experimental.pallas.ops.tpu.megablox`),
  forward and backward; rows are padded to whole tiles. In Pallas interpret mode
  (`kernels.backend.pallas_interpret`) it runs on any backend.
- `default`: megablox on TPU, ragged_dot elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from modern_jax.execution import GROUPED_IMPLS
from modern_jax.sharding.targets import platform
from modern_jax.kernels.backend import UnsupportedFeatureError, interpret_target, note_kernel
from modern_jax.kernels.masks import pad_axis, round_up



def _tile(n: int) -> int:
    """A megablox tile along a dimension of size n: 128, or the whole (small) dimension."""
    return 128 if n % 128 == 0 else n


def grouped_matmul(x_ZW, w_EWO, group_sizes_E, *, impl: str = "default"):
    """`[Z, O]` for rows `x[Z, W]` sorted by group, written in x's dtype (the compute dtype: no
    float32 copy of the output exists) and accumulated in float32 by the kernel (megablox's
    accumulator, XLA's on GPU and TPU); the backward's gradients come out in the operands'
    dtypes the same way."""
    if impl == "default":
        impl = "megablox" if platform() == "tpu" else "ragged_dot"
    note_kernel("moe_grouped", impl)
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(x_ZW, w_EWO.astype(x_ZW.dtype), group_sizes_E.astype(jnp.int32),
                                  preferred_element_type=x_ZW.dtype)
    if impl != "megablox":
        raise ValueError(f"grouped matmul impl={impl!r}: expected one of {', '.join(GROUPED_IMPLS)}")
    interpret = interpret_target() is not None
    if not interpret and platform() != "tpu":
        raise UnsupportedFeatureError(f"execution.moe_grouped_impl='megablox' is a TPU kernel; this computation is compiled "
                                      f"for {platform()!r}: use 'ragged_dot' or 'default'")
    from jax.experimental.pallas.ops.tpu.megablox import ops

    Z, W = x_ZW.shape
    O = w_EWO.shape[-1]
    tile_z = min(128, round_up(Z, 8))
    Zp = round_up(Z, tile_z)
    # padding rows join the last group: zero rows whose outputs are cut off below
    sizes_E = group_sizes_E.astype(jnp.int32).at[-1].add(Zp - Z)
    y_ZO = ops.gmm(pad_axis(x_ZW, 0, Zp), w_EWO.astype(x_ZW.dtype), sizes_E, preferred_element_type=x_ZW.dtype,
                   tiling=(tile_z, _tile(W), _tile(O)), interpret=interpret)
    return y_ZO[:Z]
